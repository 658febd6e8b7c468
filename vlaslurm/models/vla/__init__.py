"""RL policies over released OpenVLA / OpenVLA-OFT checkpoints (`vlaslurm.models.vla.build.build_released`)."""
