"""The training data: loading, bad examples by file and line, tokenization, loss masks, truncation. Imports nothing
of the recipe but the model's defaults."""
