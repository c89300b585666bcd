"""Runtime: the reference model, and training from any valid plan with torch.distributed."""
