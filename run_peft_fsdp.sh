#!/usr/bin/env bash
# LoRA + FSDP2: Llama-2-70B on one node of 8 x H100 80 GB, ultrachat-style chat data, LoRA r=8 alpha=16 on every
# linear layer, packing, bf16, activation checkpointing (non-reentrant, as the reference recipe).
# Memory:  planned per GPU and host RAM in the README's Launchers table (bench/plan_tables.py makes it from the
#          planner); `python train.py --check ...` with your flags prints the plan for your run.
# Usage:   ./run_peft_fsdp.sh [train.py flags, which override the ones below, e.g. --max_steps 10]
#          MODEL=... DATASET=... pick another model or dataset; NUM_PROCESSES=N uses N GPUs;
#          ACCELERATE_CONFIG=configs/fsdp_config.yaml for FSDP1.
set -euo pipefail
cd "$(dirname "$0")"
./preemptible.sh accelerate launch ${NUM_PROCESSES:+--num_processes "$NUM_PROCESSES"} \
  --config_file "${ACCELERATE_CONFIG:-configs/fsdp2_config.yaml}" \
  train.py configs/llama2_70b_chat_sft.yaml \
  --model_name_or_path "${MODEL:-meta-llama/Llama-2-70b-hf}" \
  --dataset_name "${DATASET:-smangrul/ultrachat-10k-chatml}" \
  --per_device_train_batch_size 8 --per_device_eval_batch_size 8 --gradient_accumulation_steps 4 \
  --use_reentrant false --output_dir outputs/llama2-70b-lora-fsdp "$@"
