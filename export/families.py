"""Model families as the export's seam: what differs between LlamaGen and the Chameleon family
(Anole, Lumina-mGPT) when checkpoints become an engine directory. Each family loads its
checkpoints through its own strict loaders, casts them, makes its graph modules, resolves its
graphs' fixed dims and writes its part of the manifest (shapes, condition, vocabulary, image);
`onnx_export` does the rest the same way for both. The runtime reads only the manifest, so
nothing below it branches on a family.

    family = family_of(target_path, target_format)   # detection
    models = family.load(target, target_format, target_options, drafter, vq)   # {role: LoadedModel}
"""
import json
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from lantern.export import chameleon, chameleon_checkpoints, chameleon_vq, checkpoints, llamagen
from lantern.export.chameleon import ARCHITECTURES
from lantern.export.graphs import graph_modules
from lantern.export.vq import load_vq
from lantern.runtime import manifest as engine_format
from lantern.runtime.chameleon_prompts import body_length
from lantern.runtime.errors import LanternError
from lantern.runtime.text_tokenizer import FILE_NAME as TOKENIZER_FILE

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint through its family's strict loader: the module and what the loader found
    (format, config, parameter count, ...: what `inspect` prints and the manifest records)."""

    model: object
    info: dict


class Family(Protocol):
    """What a model family supplies; `onnx_export` does the rest alike for every family.
    models: {role: LoadedModel} with roles target, drafter (optional), vq (optional)."""

    name: str
    condition_graph: bool  # its engines embed conditions in a graph of their own (else the target does)

    def detects(self, path, fmt=None) -> bool:
        """Whether a checkpoint path (and --format) is this family's."""

    def inspect(self, path, fmt=None, **target_options) -> dict:
        """What the loaders detect in a checkpoint of any role (LoadedModel.info)."""

    def load(self, target, target_format=None, target_options=None, drafter=None, vq=None, defer=None) -> dict:
        """{role: LoadedModel} through the strict loaders, checked against each other. defer:
        (DeferredWeights, dtype) to leave large tensors on disk until exported, where the
        family's loaders can (lantern.export.streaming); None loads everything."""

    def cast(self, models, dtype):
        """The models to the export dtype, in place (what stays fp32 is the family's choice)."""

    def graphs(self, models, candidates, attention="plain") -> dict:
        """{graph name: (contract name, torch module)}."""

    def dims(self, graph, models, candidates) -> dict:
        """The fixed dims of a graph's contract."""

    def layers(self, graph, models) -> int:
        """Per-layer cache inputs the graph takes."""

    def prefix_tokens(self, models, max_prompt_tokens=None) -> int:
        """The prefix slots of a static cache."""

    def image_tokens(self, models) -> int:
        """Tokens generated per image at the engine's grid."""

    def extra_files(self, models, vq) -> dict:
        """{file name in the engine: source path} copied beside the graphs."""

    def record(self, models, extra_files) -> dict:
        """This family's fields of the Manifest (extra_files: what extra_files() gave)."""

    def code_vectors(self, models):
        """The vectors the neighbor table is computed from."""


def _shape(layers, dim, query_heads, kv_heads, head_dim, ffn_hidden):
    return engine_format.Shape(layers=layers, dim=dim, query_heads=query_heads, kv_heads=kv_heads,
                               head_dim=head_dim, ffn_hidden=ffn_hidden)


class LlamaGen:
    """LlamaGen c2i/t2i targets (.pt or LANTERN HF), LANTERN/EAGLE drafters, LlamaGen VQ."""

    name = "llamagen"
    condition_graph = True

    def detects(self, path, fmt=None):
        return False  # the fallback of family_of: its loaders say what a file is not

    def inspect(self, path, fmt=None, **target_options):
        fmt = fmt or checkpoints.detect_format(path)
        if fmt == "drafter":
            return checkpoints.load_drafter(path)[1]
        if fmt == "vq":

            return load_vq(path)[1]
        return checkpoints.load_target(path, fmt, **target_options)[1]

    def load(self, target, target_format=None, target_options=None, drafter=None, vq=None, defer=None):
        """{role: (model, info)} through the strict loaders (all in memory: GPT-XL fits; defer
        is not used)."""

        models = {"target": LoadedModel(*checkpoints.load_target(target, target_format, **(target_options or {})))}
        args = models["target"].model.args
        if drafter is not None:
            models["drafter"] = LoadedModel(*checkpoints.load_drafter(drafter, args))
            d = models["drafter"].model.args
            if d.head_dim != args.head_dim:
                raise LanternError(f"{drafter}: drafter head_dim {d.head_dim} (dim {d.dim} / {d.n_head} heads) "
                                   f"does not fit the target's RoPE table (head_dim {args.head_dim})")
        if vq is not None:

            models["vq"] = LoadedModel(*load_vq(vq))
            codes = models["vq"].model.config.codebook_size
            if codes != args.codes:
                raise LanternError(f"{vq}: the VQ codebook has {codes} codes but the target's vocabulary is "
                                   f"{args.vocab_size}" + (f" with {args.codes} image codes" if args.image_codes else "")
                                   + "; image tokens must be the codes")
        return models

    def cast(self, models, dtype):
        """Target and drafter to the export dtype; the RoPE table stays fp32 (the rotation runs
        in fp32 inside) and the VQ decoder stays fp32."""

        target = models["target"].model.to(DTYPES[dtype])
        target.rope = llamagen.rope_table(target.args)
        if "drafter" in models:
            models["drafter"].model.to(DTYPES[dtype])
        if "vq" in models:
            models["vq"].model.float()

    def graphs(self, models, candidates, attention="plain"):
        return graph_modules(models["target"].model, _model(models, "drafter"), _model(models, "vq"), candidates,
                             attention)

    def dims(self, graph, models, candidates):
        """The fixed dims of a graph's contract (graph: its name in the engine; the commit graph
        moves the target's cache)."""
        a = models["target"].model.args
        if graph in ("target", "commit"):
            return {"L": a.n_layer, "H": a.kv_heads, "hd": a.head_dim, "D": a.dim, "V": a.vocab_size,
                    "C": a.cls_token_num}
        if graph == "drafter":
            d = models["drafter"].model.args
            return {"L": 1, "H": d.kv_heads, "hd": d.head_dim, "D": a.dim, "K": candidates}
        return {"C": a.cls_token_num, "E": a.caption_dim, "D": a.dim}

    def layers(self, graph, models):
        return models["target"].model.args.n_layer if graph in ("target", "commit") else 1

    def prefix_tokens(self, models, max_prompt_tokens=None):
        """The prefix slots of a static cache: LlamaGen's condition tokens (fixed per model)."""
        if max_prompt_tokens is not None:
            raise LanternError("--max-prompt-tokens applies to prompt (Chameleon) engines; a LlamaGen engine's "
                               "prefix is its condition tokens")
        return models["target"].model.args.cls_token_num

    def image_tokens(self, models):
        return models["target"].model.args.block_size

    def record(self, models, extra_files):
        a, t_info = models["target"].model.args, models["target"].info
        vq = _model(models, "vq")
        if a.model_type == "c2i":
            condition = engine_format.Condition(kind="class", tokens=a.cls_token_num, num_classes=a.num_classes,
                                                null_class=a.num_classes if a.class_dropout_prob > 0 else None)
        else:
            condition = engine_format.Condition(kind="caption", tokens=a.cls_token_num, caption_dim=a.caption_dim)
        fields = dict(
            family=self.name,
            model={"config": a.to_dict(), "config_name": t_info.get("config_name"), "parameters": t_info["parameters"]},
            target=_shape(a.n_layer, a.dim, a.n_head, a.kv_heads, a.head_dim, a.ffn_hidden), condition=condition,
            vocabulary=engine_format.Vocabulary(size=a.vocab_size, image_start=0, image_end=a.codes),
            image=engine_format.Image(grid_height=a.grid_size, grid_width=a.grid_size,
                                      pixels=a.grid_size * vq.config.downsample if vq is not None else None),
            max_positions=a.max_positions)
        if "drafter" in models:
            d, info = models["drafter"].model, models["drafter"].info
            fields["drafter"] = _shape(1, d.args.dim, d.args.n_head, d.args.kv_heads, d.args.head_dim,
                                       d.args.intermediate_size)
            fields["drafter_config"] = {"config": d.args.to_dict(), "parameters": info["parameters"]}
        if vq is not None:
            fields["vq"] = {"config": models["vq"].info["config"], "downsample": vq.config.downsample,
                            "vectors": "L2-normalised codes (as decoded)" if vq.config.codebook_l2_norm
                            else "codes (as decoded)"}
        return fields

    def code_vectors(self, models):
        """The vectors the neighbor table is computed from (what the decoder consumes)."""
        return models["vq"].model.code_vectors().detach().float().numpy()

    def extra_files(self, models, vq):
        return {}


DEFAULT_MAX_PROMPT_TOKENS = 128  # prompt rows of a static cache; MS-COCO captions with Lumina's template fit


class Chameleon:
    """Anole (Hugging Face layout) and Lumina-mGPT (xllmx) targets, their LANTERN drafters, and
    Meta's VQ-GAN directory (vqgan.yaml + vqgan.ckpt, with the text tokenizer beside them)."""

    name = "chameleon"
    condition_graph = False  # prompts are token ids the target embeds
    GRIDS = {"anole": (32, 32), "lumina_mgpt": (48, 48)}  # the public code's defaults (512 / 768 px)

    def detects(self, path, fmt=None):
        """--format chameleon; or, without a format, a directory whose config.json names a
        Chameleon architecture, or Meta's VQ-GAN directory (vqgan.yaml)."""
        if fmt == "chameleon":
            return True
        path = os.fspath(path)
        if not os.path.isdir(path):
            return False
        if os.path.isfile(os.path.join(path, "vqgan.yaml")):
            return True
        config = os.path.join(path, "config.json")
        if fmt is not None or not os.path.isfile(config):
            return False

        try:
            with open(config) as f:
                arch = (json.load(f).get("architectures") or [None])[0]
        except (OSError, ValueError, AttributeError):
            arch = None
        return arch in ARCHITECTURES

    def inspect(self, path, fmt=None, **target_options):
        role = chameleon_checkpoints.detect(path)["role"]
        if role == "vq":
            return chameleon_vq.load_vq(path)[1]
        if role == "drafter":
            return chameleon_checkpoints.load_drafter(path)[1]
        return chameleon_checkpoints.load_target(path)[1]

    def load(self, target, target_format=None, target_options=None, drafter=None, vq=None, defer=None):
        if target_format not in (None, "chameleon"):
            raise LanternError(f"{target}: a Chameleon directory; --format {target_format!r} does not apply")
        unused = [k for k, v in (target_options or {}).items() if v is not None and k != "weights"]
        if unused:
            raise LanternError(f"{target}: a Chameleon checkpoint carries its config; "
                               f"{', '.join('--' + k.replace('_', '-') for k in unused)} do not apply")
        models = {"target": LoadedModel(*chameleon_checkpoints.load_target(target, defer))}
        config = models["target"].model.config
        if drafter is not None:
            models["drafter"] = LoadedModel(*chameleon_checkpoints.load_drafter(drafter, config, defer))
            if models["drafter"].model.config.num_hidden_layers != 1:
                raise LanternError(f"{drafter}: the drafter graph takes one layer's cache; this drafter has "
                                   f"{models['drafter'].model.config.num_hidden_layers} layers")
        if vq is not None:
            models["vq"] = LoadedModel(*chameleon_vq.load_vq(vq))
            codes = models["vq"].model.config.codebook_size
            if codes != config.num_image_tokens:
                raise LanternError(f"{vq}: the VQ-GAN has {codes} codes but the target has {config.num_image_tokens} "
                                   f"image tokens")
        return models

    def cast(self, models, dtype):
        models["target"].model.to(DTYPES[dtype])
        if "drafter" in models:
            models["drafter"].model.to(DTYPES[dtype])
        if "vq" in models:
            models["vq"].model.float()

    def graphs(self, models, candidates, attention="plain"):
        return chameleon.graph_modules(models["target"].model, _model(models, "drafter"), _model(models, "vq"),
                                       candidates, attention)

    def dims(self, graph, models, candidates):
        c = models["target"].model.config
        if graph == "drafter":
            d = models["drafter"].model.config
            return {"L": 1, "H": d.num_key_value_heads, "hd": d.head_dim, "D": c.hidden_size, "K": candidates}
        return {"L": c.num_hidden_layers, "H": c.num_key_value_heads, "hd": c.head_dim, "D": c.hidden_size,
                "V": c.vocab_size}

    def layers(self, graph, models):
        return models["target"].model.config.num_hidden_layers if graph in ("target", "commit") else 1

    def prefix_tokens(self, models, max_prompt_tokens=None):
        """The prefix slots of a static cache: the longest prompt row it takes (BOS, the text and
        the model's closing tokens), chosen at export; shorter prompts are left-padded to it."""
        max_prompt_tokens = DEFAULT_MAX_PROMPT_TOKENS if max_prompt_tokens is None else max_prompt_tokens
        if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 4:
            raise LanternError(f"--max-prompt-tokens must be an integer >= 4, got {max_prompt_tokens!r}")
        return max_prompt_tokens

    def image_tokens(self, models):
        """Tokens generated per image at the engine's grid (a static cache holds no larger grid)."""

        c = models["target"].model.config
        return body_length(c.family, self.GRIDS[c.family])

    def record(self, models, extra_files):
        c, t_info = models["target"].model.config, models["target"].info
        h, w = self.GRIDS[c.family]
        fields = dict(
            family=self.name,
            model={"config": c.to_dict(), "format": t_info["format"], "parameters": t_info["parameters"],
                   "image_token_mapping": t_info.get("image_token_mapping")},
            target=_shape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          c.intermediate_size),
            condition=engine_format.Condition(kind="prompt", style=c.family,
                                              tokenizer=TOKENIZER_FILE if TOKENIZER_FILE in extra_files else None),
            vocabulary=engine_format.Vocabulary(size=c.vocab_size, image_start=c.image_token_start,
                                                image_end=c.image_token_end),
            image=engine_format.Image(grid_height=h, grid_width=w, pixels=h * 16 if "vq" in models else None),
            max_positions=c.max_position_embeddings)
        if "drafter" in models:
            d, info = models["drafter"].model, models["drafter"].info
            dc = d.config
            fields["drafter"] = _shape(1, dc.hidden_size, dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim,
                                       dc.intermediate_size)
            fields["drafter_config"] = {"config": dc.to_dict(), "parameters": info["parameters"]}
        if "vq" in models:
            fields["vq"] = {"config": models["vq"].info["config"], "downsample": models["vq"].model.config.downsample,
                            "vectors": "quantize.embedding.weight (as LANTERN's generate_codebook.py)"}
        return fields

    def code_vectors(self, models):
        return models["vq"].model.code_vectors().detach().float().numpy()

    def extra_files(self, models, vq):
        """The text tokenizer travels with the engine, so prompts can be given as text."""
        path = os.path.join(vq, TOKENIZER_FILE) if vq is not None else None
        return {TOKENIZER_FILE: path} if path is not None and os.path.isfile(path) else {}


FAMILIES = {"llamagen": LlamaGen(), "chameleon": Chameleon()}  # the seam: a new family is one more entry


def family_of(path, fmt=None):
    """The family of a checkpoint (any role): the one that claims it, else LlamaGen."""
    return next((f for f in FAMILIES.values() if f.detects(path, fmt)), FAMILIES["llamagen"])


def _model(models, role):
    return models[role].model if role in models else None
