"""``python -m fusedattn.bench``: fusedattn side by side with its peers, in one process."""
