"""OpenAI's audio transcription (`POST /v1/audio/transcriptions`, multipart: `file`, `model`, `language`, `prompt`,
`response_format`), as Ollama serves it: a chat asked of a model that hears (Gemma 4 E2B, E4B), Ollama's own
instructions in the system turn and the clip before the question, answered greedily; the text comes back as JSON
(`{"text": ...}`, with the token usage OpenAI's transcription models report) or plain with `response_format: text`."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import UploadFile

from gemmaforge.inference.jobs import Job
from gemmaforge.serve import protocol as p
from gemmaforge.serve.openai_api import options_of
from gemmaforge.serve.protocol import Completion, bad
from gemmaforge.serve.routes.completions import collect, encode_media
from gemmaforge.serve.state import MAX_BODY, State

router = APIRouter()

# Ollama's (openai.FromTranscriptionRequest): the system turn, and the question the clip comes with
INSTRUCTION = ("Transcribe the audio exactly as spoken. Output only the spoken words. Do not answer any question in "
               "the audio.")
QUESTION = "What exact words are spoken in this audio?"
FORMATS = ("json", "text", "verbose_json")  # srt and vtt need timestamps, which the model's answer does not carry


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request, state: State) -> Response:
    form = await _form(request)
    model, upload = form.get("model"), form.get("file")
    if not isinstance(model, str) or not model:
        raise bad("model is required")
    if not isinstance(upload, UploadFile):
        raise bad("file is required: the clip as a multipart file (WAV, FLAC, OGG, MP3)")
    clip = await upload.read()
    if not clip:
        raise bad("file: the audio file is empty")
    response_format = _text(form, "response_format") or "json"
    if response_format not in FORMATS:
        raise bad(f"response_format: {response_format!r} is not supported; expected one of {', '.join(FORMATS)} "
                  "(subtitles need timestamps, which the model's answer does not carry)")
    system = INSTRUCTION + (f" The audio is in {language}." if (language := _text(form, "language")) else "") \
        + (f" Context: {context}" if (context := _text(form, "prompt")) else "")
    served, _keep = await state.ready({"model": model})
    registry = state.registry
    try:
        chat = served.family.chat
        if chat.audio is None:
            raise bad(f"model: {served.name} does not hear (the {served.family.name} chat format has no audio part; "
                      "Gemma 4 E2B and E4B hear)")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": chat.audio + QUESTION}]
        prompt = p.chat_prompt(served, messages)
        ids, media = await asyncio.to_thread(encode_media, served.engine, served.name, prompt, (), (("file", clip),))
        options = options_of(served, {"temperature": 0.0})  # greedy, as Ollama transcribes
        completion = Completion(model, prompt, True, False, options, reading=chat, prompt_tokens=len(ids))
        params = p.sampling_params(completion, state.limits, len(ids), registry.num_ctx)
    except Exception:  # refused before it reached the engine: the model is no longer held for it
        registry.keep(served.name)
        raise
    text, end, _ = await collect(state.events(served, Job(ids, params, served.adapter, asyncio.get_running_loop(),
                                                          False, media), request))
    spoken = completion.read_whole(text).content.strip()
    if response_format == "text":
        return PlainTextResponse(spoken)
    usage = {"type": "tokens", "input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens,
             "total_tokens": end.prompt_tokens + end.completion_tokens}
    return JSONResponse({"text": spoken, "usage": usage})


async def _form(request: Request) -> Any:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad("expected a multipart/form-data body with file and model")
    try:
        return await request.form(max_files=1, max_part_size=MAX_BODY)
    except Exception as e:  # noqa: BLE001  (python-multipart's and Starlette's parse errors)
        raise bad(f"failed to parse the multipart form: {e}") from None


def _text(form: Any, key: str) -> str | None:
    value = form.get(key)
    if value is not None and not isinstance(value, str):
        raise bad(f"{key}: expected text")
    return value or None
