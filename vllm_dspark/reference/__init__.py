"""The FP32 reference drafter: the DSpark math written out in plain torch, the oracle for everything else."""
