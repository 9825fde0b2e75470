"""The FP32 reference drafter: the DSpark math written out in plain torch, the oracle for everything else."""

# name -> (required, description) for --help and error messages.
INPUT_TENSORS: dict[str, tuple[bool, str]] = {
    "aux_hidden_states": (
        True,
        "[B, T, num_target_layers*target_hidden_size] float: target aux hidden states",
    ),
    "context_positions": (True, "[B, T] int64: positions of the context tokens"),
    "anchor_ids": (True, "[B] int64: last verified token per request"),
    "context_mask": (False, "[B, T] bool: False marks padding (default all True)"),
    "seeds": (False, "[B] int64: sampling seeds (needed when temperature > 0)"),
    "temperature": (False, "[B] float: 0 = greedy (default)"),
}
OUTPUT_TENSORS: dict[str, str] = {
    "draft_tokens": "[B, N] int64",
    "logits": "[B, N, V] fp32, pre-temperature, Markov bias included",
    "confidences": "[B, N] fp32 in (0, 1) (drafters with a confidence head)",
    "block_positions": "[B, N] int64",
}
