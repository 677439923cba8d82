"""Models for the decoders: the ARImageModel protocol, a LlamaGen-style GPT, the embedded
tokenizer and default family (`default()`), the one family type every loader returns (`ModelFamily`),
loaders of LlamaGen checkpoints and transformers folders (`load_family`) and the quality evaluator."""
from specdec.models.conditions import Prompts
from specdec.models.default import default
from specdec.models.family import ModelFamily
from specdec.models.evaluator import FashionClassifier, QualityEvaluator, QualityReport, frechet_distance
from specdec.models.gpt import LLAMAGEN_CONFIGS, GPTConfig, LlamaGenGPT
from specdec.models.kv_cache import SlotKVCache
from specdec.models.captions import read_caption_embeddings
from specdec.models.llamagen_family import load_llamagen_family
from specdec.models.loading import LoadError, load_family
from specdec.models.llamagen_vq import LlamaGenVQ, LlamaGenVQConfig
from specdec.models.loaders import (CheckpointMismatchError, llamagen_manifest, load_llamagen,
                                    load_llamagen_vq, read_state_dict)
from specdec.models.protocol import ARImageModel, ForwardOutput, cfg_logits, split_cfg
from specdec.models.sampling import sample_ar, sample_logits
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig
from specdec.models.vq import VQConfig, VQTokenizer

__all__ = ["ARImageModel", "CheckpointMismatchError", "Prompts", "FashionClassifier", "ForwardOutput",
           "GPTConfig", "LLAMAGEN_CONFIGS", "LoadError", "ModelFamily", "LlamaGenGPT", "LlamaGenVQ", "LlamaGenVQConfig",
           "QualityEvaluator", "QualityReport", "SSDHeads", "SSDHeadsConfig", "SlotKVCache", "VQConfig",
           "VQTokenizer", "cfg_logits", "default", "frechet_distance", "llamagen_manifest", "load_llamagen",
           "load_family", "load_llamagen_family", "load_llamagen_vq", "read_caption_embeddings", "read_state_dict",
           "sample_ar", "sample_logits", "split_cfg"]
