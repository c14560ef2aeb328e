"""The `fleet` command line: one module per noun, each command a few lines over the SDK."""
