"""Pure foundations every layer uses: configuration model, errors, outcomes, paths, auth."""
