"""`python memory.py ...`: the memory plan of a run, from a model's config (memory.py plans it).

    .venv/bin/python memory.py --model llama-2-70b --method qlora --engine fsdp --gpus 2 --offload --batch 2 --seq 2048
"""

from recipe.planning.memory import main

if __name__ == "__main__":
    main()
