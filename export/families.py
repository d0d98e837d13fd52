"""Model families as the export's seam: what differs between LlamaGen and the Chameleon family
(Anole, Lumina-mGPT) when checkpoints become an engine directory. Each family loads its
checkpoints through its own strict loaders, casts them, makes its graph modules, resolves its
graphs' fixed dims and writes its part of the manifest (shapes, condition, vocabulary, image);
`onnx_export` does the rest the same way for both. The runtime reads only the manifest, so
nothing below it branches on a family.

    family = family_of(target_path, target_format)   # detection
    models = family.load(target, target_format, target_options, drafter, vq)
"""
import os

import torch

from lantern.runtime import manifest as engine_format
from lantern.runtime.errors import LanternError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _shape(layers, dim, query_heads, kv_heads, head_dim, ffn_hidden):
    return engine_format.Shape(layers=layers, dim=dim, query_heads=query_heads, kv_heads=kv_heads,
                               head_dim=head_dim, ffn_hidden=ffn_hidden)


class LlamaGen:
    """LlamaGen c2i/t2i targets (.pt or LANTERN HF), LANTERN/EAGLE drafters, LlamaGen VQ."""

    name = "llamagen"

    def load(self, target, target_format=None, target_options=None, drafter=None, vq=None):
        """{role: (model, info)} through the strict loaders."""
        from lantern.export import checkpoints

        models = {"target": checkpoints.load_target(target, target_format, **(target_options or {}))}
        args = models["target"][0].args
        if drafter is not None:
            models["drafter"] = checkpoints.load_drafter(drafter, args)
            d = models["drafter"][0].args
            if d.head_dim != args.head_dim:
                raise LanternError(f"{drafter}: drafter head_dim {d.head_dim} (dim {d.dim} / {d.n_head} heads) "
                                   f"does not fit the target's RoPE table (head_dim {args.head_dim})")
        if vq is not None:
            from lantern.export.vq import load_vq

            models["vq"] = load_vq(vq)
            codes = models["vq"][0].config.codebook_size
            if codes != args.vocab_size:
                raise LanternError(f"{vq}: the VQ codebook has {codes} codes but the target's vocabulary is "
                                   f"{args.vocab_size}; image tokens must be the codes")
        return models

    def cast(self, models, dtype):
        """Target and drafter to the export dtype; the RoPE table stays fp32 (the rotation runs
        in fp32 inside) and the VQ decoder stays fp32."""
        from lantern.export import llamagen

        target = models["target"][0].to(DTYPES[dtype])
        target.rope = llamagen.rope_table(target.args)
        if "drafter" in models:
            models["drafter"][0].to(DTYPES[dtype])
        if "vq" in models:
            models["vq"][0].float()

    def graphs(self, models, candidates, attention="plain"):
        from lantern.export.graphs import graph_modules

        return graph_modules(models["target"][0], _model(models, "drafter"), _model(models, "vq"), candidates,
                             attention)

    def dims(self, graph, models, candidates):
        """The fixed dims of a graph's contract (graph: its name in the engine; the commit graph
        moves the target's cache)."""
        a = models["target"][0].args
        if graph in ("target", "commit"):
            return {"L": a.n_layer, "H": a.kv_heads, "hd": a.head_dim, "D": a.dim, "V": a.vocab_size,
                    "C": a.cls_token_num}
        if graph == "drafter":
            d = models["drafter"][0].args
            return {"L": 1, "H": d.kv_heads, "hd": d.head_dim, "D": a.dim, "K": candidates}
        return {"C": a.cls_token_num, "E": a.caption_dim, "D": a.dim}

    def layers(self, graph, models):
        return models["target"][0].args.n_layer if graph in ("target", "commit") else 1

    def prefix_tokens(self, models, max_prompt_tokens=None):
        """The prefix slots of a static cache: LlamaGen's condition tokens (fixed per model)."""
        if max_prompt_tokens is not None:
            raise LanternError("--max-prompt-tokens applies to prompt (Chameleon) engines; a LlamaGen engine's "
                               "prefix is its condition tokens")
        return models["target"][0].args.cls_token_num

    def image_tokens(self, models):
        return models["target"][0].args.block_size

    def record(self, models, t_info):
        """This family's fields of the Manifest."""
        a = models["target"][0].args
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
            vocabulary=engine_format.Vocabulary(size=a.vocab_size, image_start=0, image_end=a.vocab_size),
            image=engine_format.Image(grid_height=a.grid_size, grid_width=a.grid_size,
                                      pixels=a.grid_size * vq.config.downsample if vq is not None else None),
            max_positions=a.max_positions)
        if "drafter" in models:
            d, info = models["drafter"]
            fields["drafter"] = _shape(1, d.args.dim, d.args.n_head, d.args.kv_heads, d.args.head_dim,
                                       d.args.intermediate_size)
            fields["drafter_config"] = {"config": d.args.to_dict(), "parameters": info["parameters"]}
        if vq is not None:
            fields["vq"] = {"config": models["vq"][1]["config"], "downsample": vq.config.downsample,
                            "vectors": "L2-normalised codes (as decoded)" if vq.config.codebook_l2_norm
                            else "codes (as decoded)"}
        return fields

    def code_vectors(self, models):
        """The vectors the neighbour table is computed from (what the decoder consumes)."""
        return models["vq"][0].code_vectors().detach().float().numpy()

    def extra_files(self, models, vq):
        return {}


DEFAULT_MAX_PROMPT_TOKENS = 128  # prompt rows of a static cache; MS-COCO captions with Lumina's template fit


class Chameleon:
    """Anole (Hugging Face layout) and Lumina-mGPT (xllmx) targets, their LANTERN drafters, and
    Meta's VQ-GAN directory (vqgan.yaml + vqgan.ckpt, with the text tokenizer beside them)."""

    name = "chameleon"
    GRIDS = {"anole": (32, 32), "lumina_mgpt": (48, 48)}  # the public code's defaults (512 / 768 px)

    def load(self, target, target_format=None, target_options=None, drafter=None, vq=None):
        from lantern.export import chameleon_checkpoints

        if target_format not in (None, "chameleon"):
            raise LanternError(f"{target}: a Chameleon directory; --format {target_format!r} does not apply")
        unused = [k for k, v in (target_options or {}).items() if v is not None and k != "weights"]
        if unused:
            raise LanternError(f"{target}: a Chameleon checkpoint carries its config; "
                               f"{', '.join('--' + k.replace('_', '-') for k in unused)} do not apply")
        models = {"target": chameleon_checkpoints.load_target(target)}
        config = models["target"][0].config
        if drafter is not None:
            models["drafter"] = chameleon_checkpoints.load_drafter(drafter, config)
            if models["drafter"][0].config.num_hidden_layers != 1:
                raise LanternError(f"{drafter}: the drafter graph takes one layer's cache; this drafter has "
                                   f"{models['drafter'][0].config.num_hidden_layers} layers")
        if vq is not None:
            from lantern.export.chameleon_vq import load_vq

            models["vq"] = load_vq(vq)
            codes = models["vq"][0].config.codebook_size
            if codes != config.num_image_tokens:
                raise LanternError(f"{vq}: the VQ-GAN has {codes} codes but the target has {config.num_image_tokens} "
                                   f"image tokens")
        return models

    def cast(self, models, dtype):
        models["target"][0].to(DTYPES[dtype])
        if "drafter" in models:
            models["drafter"][0].to(DTYPES[dtype])
        if "vq" in models:
            models["vq"][0].float()

    def graphs(self, models, candidates, attention="plain"):
        from lantern.export import chameleon

        return chameleon.graph_modules(models["target"][0], _model(models, "drafter"), _model(models, "vq"),
                                       candidates, attention)

    def dims(self, graph, models, candidates):
        c = models["target"][0].config
        if graph == "drafter":
            d = models["drafter"][0].config
            return {"L": 1, "H": d.num_key_value_heads, "hd": d.head_dim, "D": c.hidden_size, "K": candidates}
        return {"L": c.num_hidden_layers, "H": c.num_key_value_heads, "hd": c.head_dim, "D": c.hidden_size,
                "V": c.vocab_size}

    def layers(self, graph, models):
        return models["target"][0].config.num_hidden_layers if graph in ("target", "commit") else 1

    def prefix_tokens(self, models, max_prompt_tokens=None):
        """The prefix slots of a static cache: the longest prompt row it takes (BOS, the text and
        the model's closing tokens), chosen at export; shorter prompts are left-padded to it."""
        max_prompt_tokens = DEFAULT_MAX_PROMPT_TOKENS if max_prompt_tokens is None else max_prompt_tokens
        if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 4:
            raise LanternError(f"--max-prompt-tokens must be an integer >= 4, got {max_prompt_tokens!r}")
        return max_prompt_tokens

    def image_tokens(self, models):
        """Tokens generated per image at the engine's grid (a static cache holds no larger grid)."""
        from lantern.runtime.chameleon_prompts import body_length

        c = models["target"][0].config
        return body_length(c.family, self.GRIDS[c.family])

    def record(self, models, t_info):
        c = models["target"][0].config
        h, w = self.GRIDS[c.family]
        fields = dict(
            family=self.name,
            model={"config": c.to_dict(), "format": t_info["format"], "parameters": t_info["parameters"],
                   "image_token_mapping": t_info.get("image_token_mapping")},
            target=_shape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          c.intermediate_size),
            condition=engine_format.Condition(kind="prompt", style=c.family),
            vocabulary=engine_format.Vocabulary(size=c.vocab_size, image_start=c.image_token_start,
                                                image_end=c.image_token_end),
            image=engine_format.Image(grid_height=h, grid_width=w, pixels=h * 16 if "vq" in models else None),
            max_positions=c.max_position_embeddings)
        if "drafter" in models:
            d, info = models["drafter"]
            dc = d.config
            fields["drafter"] = _shape(1, dc.hidden_size, dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim,
                                       dc.intermediate_size)
            fields["drafter_config"] = {"config": dc.to_dict(), "parameters": info["parameters"]}
        if "vq" in models:
            fields["vq"] = {"config": models["vq"][1]["config"], "downsample": models["vq"][0].config.downsample,
                            "vectors": "quantize.embedding.weight (as LANTERN's generate_codebook.py)"}
        return fields

    def code_vectors(self, models):
        return models["vq"][0].code_vectors().detach().float().numpy()

    def extra_files(self, models, vq):
        """The text tokenizer travels with the engine, so prompts can be given as text."""
        from lantern.runtime.text_tokenizer import FILE_NAME

        path = os.path.join(vq, FILE_NAME) if vq is not None else None
        return {FILE_NAME: path} if path is not None and os.path.isfile(path) else {}


FAMILIES = {"llamagen": LlamaGen(), "chameleon": Chameleon()}


def family_of(target, target_format=None):
    """The family of a target checkpoint: a directory whose config.json names a Chameleon
    architecture is Chameleon; anything else goes to LlamaGen's loaders."""
    if target_format == "chameleon":
        return FAMILIES["chameleon"]
    path = os.fspath(target)
    config = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(config):
        import json

        try:
            with open(config) as f:
                arch = (json.load(f).get("architectures") or [None])[0]
        except (OSError, ValueError, AttributeError):
            arch = None
        from lantern.export.chameleon import ARCHITECTURES

        if arch in ARCHITECTURES:
            return FAMILIES["chameleon"]
    return FAMILIES["llamagen"]


def _model(models, role):
    return models[role][0] if role in models else None
