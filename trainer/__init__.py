"""Stoker's training engine. `run(cfg)` is the whole public entry point."""


def run(cfg):
    """Trains as the composed config says; see trainer.runner.run."""
    from trainer.runner import run as _run  # lazy: keeps `import trainer.config` light

    return _run(cfg)
