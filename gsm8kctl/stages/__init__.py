"""One module per stage; each exposes a plain function that the CLI and the loop call."""
