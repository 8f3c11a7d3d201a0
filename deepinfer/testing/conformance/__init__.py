"""The backend conformance suite. Run it with `deepinfer conformance --backend NAME`."""
