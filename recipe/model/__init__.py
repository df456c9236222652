"""The model as the recipe builds and runs it: where weights come from (`model_files`), the tokenizer and its chat
template (`tokenizer`), mixtures of experts split into linear modules (`moe`), and the fast paths of a step
(`fast_paths`: attention per packed example, fused kernels, compile). Imports compat and the platform folder."""
