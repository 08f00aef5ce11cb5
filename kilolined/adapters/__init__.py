"""What differs per backend kind (docs/API.md "Route kinds"): ``generic`` is the identity,
``comfyui`` and ``openai`` know their APIs. ``registry.adapter_for`` picks one by kind."""
