"""The worker (rank) processes: the model worker's step, its page table and the pool's tensors."""
