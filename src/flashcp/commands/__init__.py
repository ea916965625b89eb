"""The handlers of flashcp's subcommands, one module per role (`cli` holds the parser and
dispatches to them). Each imports what it runs when it runs: Paddle is an optional extra."""
