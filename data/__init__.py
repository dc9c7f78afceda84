"""Stoker's input pipeline: datasets, samplers, per-rank loaders, device prefetching."""
