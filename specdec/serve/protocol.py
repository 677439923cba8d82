"""The wire format: the body of `POST /v1/images/generations` (OpenAI's Images API fields, then
specdec's own, then any option of the method as a top-level field), and the JSON the server
answers with: the response, the server-sent events of a stream, the per-image statistics.

Types are strict (a number in a string, or `true` for an int, is refused) so that a field is
either what it says or a 400 that names it."""
from __future__ import annotations

import json
from typing import Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.serve.errors import APIError, invalid

#: OpenAI's fields that specdec accepts and ignores (nothing in specdec answers to them)
IGNORED_FIELDS = ("quality", "moderation", "style", "safety_identifier")


class ImageGenerationBody(BaseModel):
    """`POST /v1/images/generations`. Fields not declared here are the method's options (`tau`,
    `chunk`, ...), checked against the method once it is known."""

    model_config = ConfigDict(extra="allow", strict=True)

    # ---- OpenAI's Images API ----
    prompt: str = Field(max_length=4000)
    model: Optional[str] = None
    n: Optional[int] = None
    size: Optional[str] = None
    response_format: Optional[str] = None
    output_format: Optional[str] = None
    output_compression: Optional[int] = None
    stream: Optional[bool] = None
    partial_images: Optional[int] = None
    user: Optional[str] = Field(default=None, max_length=256)
    background: Optional[str] = None
    quality: Optional[str] = None
    moderation: Optional[str] = None
    style: Optional[str] = None
    safety_identifier: Optional[str] = None
    # ---- specdec's own (the openai clients send them with extra_body) ----
    method: Optional[str] = None
    seed: Optional[int] = None
    class_id: Optional[int] = None
    first_index: Optional[int] = None
    preset: Optional[str] = None
    cfg_scale: Optional[float] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    cfg_interval: Optional[float] = None
    cfg_rule: Optional[str] = None
    return_tokens: Optional[bool] = None
    exact: Optional[bool] = None

    @property
    def options(self) -> Dict[str, object]:
        """The fields that are none of the above: the method's options."""
        return dict(self.model_extra or {})


#: the Sampling fields a request may set
SAMPLING_FIELDS = ("cfg_scale", "temperature", "top_k", "top_p", "cfg_interval", "cfg_rule")


def parse_body(raw: bytes) -> ImageGenerationBody:
    """The request body, or a 400 that names the first field in error (None: the body itself)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise invalid("the body is nested too deeply", None, "invalid_json") from None
    except ValueError as e:   # (bad UTF-8, bad JSON, a number of more digits than Python reads)
        raise invalid(f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object", None, "invalid_json")
    try:
        return ImageGenerationBody.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        code = "missing_required_parameter" if first["type"] == "missing" else "invalid_type"
        raise invalid(f"{param}: {first['msg']}", param, code) from None
    except RecursionError:   # (a body nested deeper than the parser's stack)
        raise invalid("the body is nested too deeply", None, "invalid_json") from None


def usage(images: int, tokens_per_image: int) -> dict:
    """OpenAI's usage block: the image tokens generated (a class id is no text input)."""
    out = images * tokens_per_image
    return {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
            "output_tokens": out, "total_tokens": out,
            "output_tokens_details": {"image_tokens": out, "text_tokens": 0}}


def image_stats(j: int, finished, latency_s: float, first_partial_s: Optional[float]) -> dict:
    """One image's figures: `index` its place in the request, `stream_index` the image index of
    its seed's stream (`decode(..., first_index=...)`), then its own decode statistics."""
    s = finished.stats
    drafted, kept = sum(s.drafted), sum(s.accepted)
    return {"index": j, "stream_index": finished.index, "target_passes": s.target_passes[0],
            "tokens_fed": s.tokens_fed[0], "draft_passes": s.draft_passes[0], "drafted": drafted,
            "accepted": kept, "acceptance": kept / drafted if drafted else None,
            "latency_s": round(latency_s, 6),
            "time_to_first_partial_s": None if first_partial_s is None else round(first_partial_s, 6)}


def specdec_block(plan, stats: List[dict]) -> dict:
    """What only specdec reports: the method, mode and seed that made the images, and each one's figures."""
    return {"method": plan.key.method, "exact": plan.key.exact, "seed": plan.seed, "first_index": plan.first_index,
            "images": stats}


def images_response(plan, created: int, items: List[dict], stats: List[dict], tokens_per_image: int) -> dict:
    return {"created": created, "data": items, "background": "opaque", "output_format": plan.output_format,
            "size": plan.size, "usage": usage(len(items), tokens_per_image), "specdec": specdec_block(plan, stats)}


def partial_event(plan, j: int, partial_index: int, b64: str, created: int) -> dict:
    return {"type": "image_generation.partial_image", "b64_json": b64, "background": "opaque",
            "created_at": created, "output_format": plan.output_format, "partial_image_index": partial_index,
            "quality": "auto", "size": plan.size, "index": j}


def completed_event(plan, j: int, b64: str, created: int, stats: dict, tokens_per_image: int,
                    tokens: Optional[list] = None) -> dict:
    event = {"type": "image_generation.completed", "b64_json": b64, "background": "opaque", "created_at": created,
             "output_format": plan.output_format, "quality": "auto", "size": plan.size,
             "usage": usage(1, tokens_per_image), "index": j, "specdec": specdec_block(plan, [stats])}
    if tokens is not None:
        event["tokens"] = tokens
    return event


def sse(event: str, data: dict) -> bytes:
    """One server-sent event."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def error_event(error: APIError) -> bytes:
    return sse("error", error.body)


__all__ = ["IGNORED_FIELDS", "ImageGenerationBody", "SAMPLING_FIELDS", "completed_event", "error_event",
           "image_stats", "images_response", "parse_body", "partial_event", "specdec_block", "sse", "usage"]
