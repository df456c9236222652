"""The training data: loading, bad examples by file and line, tokenization, loss masks, truncation for padding-free
batches, tokenizing in several processes. Imports nothing else of the recipe."""
