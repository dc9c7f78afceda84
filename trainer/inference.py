"""load_model: a run's model with a checkpoint's weights, for use outside Stoker (inference,
evaluation of one's own, export); image_inputs: image files as that model's run fed them."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, Union

import torch
from omegaconf import OmegaConf

from trainer import components
from trainer.checkpoint import CheckpointError, load


def load_model(path: Union[str, Path], device: Union[str, torch.device] = "cpu"
               ) -> torch.nn.Module:
    """The model a Stoker checkpoint (`last.pt`, `best.pt`, `step-*.pt`) holds: built from the
    run's config kept in the file as the run built it (`data.input_shape` and
    `data.num_classes` offered where its `_target_` takes them), with the file's weights, on
    `device`, in eval mode. The `_target_` must import as it did for the run (the same working
    folder, or its package on the path). CheckpointError for a file that is not a whole
    Stoker checkpoint (its checksums are checked first)."""
    state = load(Path(path), "cpu")
    cfg = OmegaConf.create(state.get("config") or {})
    if OmegaConf.select(cfg, "model._target_") is None:
        raise CheckpointError(f"checkpoint {path}: keeps no model config (model._target_) to "
                              "build the model from")
    model = components.build_model(cfg)
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def image_inputs(path: Union[str, Path], images: Sequence[Any],
                 device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Image files (paths or open binary files) as the model of the checkpoint at `path` saw
    its validation images: decoded and centre-cropped as its run's image folder or image
    shards did (`data.dataset.size` and `resize`; packed arrays, `data=memmap`: the size their
    `input_shape` holds, resized by the default size / 0.875), scaled to [0, 1] and normalised
    by the run's `data.normalize_mean/std`; a float (N, 3, size, size) batch on `device`.
    CheckpointError for a run whose inputs were no images."""
    from data.images import decode, default_resize
    from data.prefetch import InputTransform

    state = load(Path(path), "cpu")
    data = OmegaConf.create(state.get("config") or {}).get("data") or {}
    dataset = data.get("dataset") or {}
    shape = data.get("input_shape")
    # an image folder's or shards' size; packed arrays of images (data=memmap) carry the
    # ImageNet normalisation their pack recorded (a synthetic [3, s, s] set carries none)
    square = isinstance(shape, Sequence) and len(shape) == 3 and shape[0] == 3 and \
        shape[1] == shape[2]
    size = dataset.get("size") if isinstance(dataset.get("size"), int) else (
        shape[-1] if square and data.get("normalize_mean") is not None else None)
    if size is None:
        if square:  # (images, read by a dataset that records no size nor normalisation)
            raise CheckpointError(
                f"checkpoint {path}: its run read its images through "
                f"data.dataset._target_={dataset.get('_target_')}, whose decoding, size and "
                "normalisation the checkpoint does not record (image_inputs knows the image "
                "folders, image shards and packed arrays of data=image_folder, data=shards "
                "and data=memmap); prepare the images as that dataset does")
        raise CheckpointError(f"checkpoint {path}: its run's inputs were no square RGB "
                              f"images (data.input_shape {_shown(shape)}); prepare them as its "
                              "dataset did")
    resize = default_resize(size, dataset.get("resize"))
    batch = torch.stack([decode(image, size, resize) for image in images])
    transform = InputTransform(data.get("normalize_mean"), data.get("normalize_std"))
    return transform([batch.to(device)])[0]


def _shown(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
