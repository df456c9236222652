"""The recipe's library. `train.py` tells the story and `utils.py` builds the model, tokenizer and LoRA config; what
they stand on lives here, one folder per concern. Imports run one way, lowest first:

    compat, platform  <  settings, model, data  <  planning  <  engines, reporting

`recipe/compat.py`: every change the recipe makes to a library's internals (imported first by train.py).
"""
