#!/usr/bin/env bash
# QLoRA + DeepSpeed ZeRO-3: Llama-2-70B on 2 GPUs. Rank 0 reads and quantizes in host RAM, the other rank builds on
# the meta device, and DeepSpeed partitions one module at a time (recipe/engines/sharding.py; proven on 2 CPU
# processes).
# Memory:  planned per GPU and host RAM in the README's Launchers table (bench/plan_tables.py makes it from the
#          planner); `python train.py --check ...` with your flags prints the plan for your run.
# Usage:   ./run_peft_qlora_deepspeed.sh [train.py flags that override the ones below]
#          MODEL=... DATASET=... pick another model or dataset;
#          NUM_PROCESSES=N uses N GPUs. Needs `pip install -r requirements-gpu.txt`.
set -euo pipefail
cd "$(dirname "$0")"
./preemptible.sh accelerate launch ${NUM_PROCESSES:+--num_processes "$NUM_PROCESSES"} \
  --config_file "${ACCELERATE_CONFIG:-configs/deepspeed_config_z3_qlora.yaml}" \
  train.py configs/llama2_70b_chat_sft.yaml \
  --model_name_or_path "${MODEL:-meta-llama/Llama-2-70b-hf}" \
  --dataset_name "${DATASET:-smangrul/ultrachat-10k-chatml}" \
  --per_device_train_batch_size 2 --per_device_eval_batch_size 2 --gradient_accumulation_steps 2 \
  --use_reentrant true --use_4bit_quantization true --use_nested_quant true \
  --bnb_4bit_compute_dtype bfloat16 --bnb_4bit_quant_storage_dtype bfloat16 \
  --output_dir outputs/llama2-70b-qlora-deepspeed "$@"
