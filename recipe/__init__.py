"""The recipe's library. `train.py` tells the story and `utils.py` builds the model and the LoRA config; what they stand
on lives here, one folder per concern. Imports run one way, from each folder to its own and lower ones
(tests/test_layout.py checks every import, inside functions too):

    compat < platform < model < data < planning < engines < settings < reporting

`compat.py`: every change the recipe makes to a library's internals, importing nothing of the recipe (what a patch
needs of it is handed in). `settings` sits high: its decisions and preflight's rules read the plan, the engines' CPU
overrides and the checkpoints on disk.
"""
