from kilolined.cli import main

raise SystemExit(main())
