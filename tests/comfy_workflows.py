"""ComfyUI workflows (API format) the image tests and the API examples send."""

from __future__ import annotations

from typing import Any

TXT2IMG: dict[str, Any] = {
    "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}},
    "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
    "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
    "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
    "3": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                                               "latent_image": ["5", 0], "seed": 1, "steps": 2}},
    "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
    "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
}


TXT2IMG_INPUTS = {"prompt": "6.inputs.text", "negative_prompt": "7.inputs.text", "seed": "3.inputs.seed",
                  "width": "5.inputs.width", "height": "5.inputs.height", "n": "5.inputs.batch_size"}


INVERT: dict[str, Any] = {
    "10": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
    "11": {"class_type": "ImageInvert", "inputs": {"image": ["10", 0]}},
    "12": {"class_type": "SaveImage", "inputs": {"images": ["11", 0], "filename_prefix": "edit"}},
}
