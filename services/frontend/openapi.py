"""The frontend's HTTP API as an OpenAPI 3.1 document, served at ``GET /openapi.json``.

``document(max_body_bytes)`` is a pure function: the request bodies are the JSON Schemas of
the msgspec types the frontend decodes (``services.frontend.openai_types``), so the document
cannot drift from what is accepted; the response bodies are written out here after
``services.frontend.responses``. Every failure is the OpenAI error body
(``{"error": {message, type, param, code}}``). The ``/v1`` routes declare a bearer key
(``Authorization: Bearer``); ``/health``, ``/metrics`` and this document need none.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.frontend.fine_tuning import JobRequest
from services.frontend.openai_types import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{name}"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF.format(name=name)}


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NULL_STR = {"type": ["string", "null"]}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", None]}

_RESPONSES: dict[str, Any] = {
    "Error": _obj(
        ["error"],
        error=_obj(
            ["message", "type", "param", "code"],
            message=_STR,
            type=_STR,
            param=_NULL_STR,
            code=_NULL_STR,
        ),
    ),
    "Usage": _obj(
        ["prompt_tokens", "completion_tokens", "total_tokens"],
        prompt_tokens=_INT,
        completion_tokens=_INT,
        total_tokens=_INT,
        prompt_tokens_details=_obj(["cached_tokens"], cached_tokens=_INT),
    ),
    "ChatCompletion": _obj(
        ["id", "object", "created", "model", "choices", "usage"],
        id=_STR,
        object={"const": "chat.completion"},
        created=_INT,
        model=_STR,
        choices={
            "type": "array",
            "items": _obj(
                ["index", "message", "finish_reason"],
                index=_INT,
                message=_obj(["role", "content"], role={"const": "assistant"}, content=_NULL_STR),
                logprobs={"type": "null"},
                finish_reason=_FINISH,
            ),
        },
        usage=_ref("Usage"),
    ),
    "Completion": _obj(
        ["id", "object", "created", "model", "choices", "usage"],
        id=_STR,
        object={"const": "text_completion"},
        created=_INT,
        model=_STR,
        choices={
            "type": "array",
            "items": _obj(
                ["text", "index", "finish_reason"],
                text=_STR,
                index=_INT,
                logprobs={"type": "null"},
                finish_reason=_FINISH,
            ),
        },
        usage=_ref("Usage"),
    ),
    "Model": _obj(
        ["id", "object", "created", "owned_by"],
        id=_STR,
        object={"const": "model"},
        created=_INT,
        owned_by=_STR,
        max_model_len=_INT,
        parent=_STR,  # a fine-tuned model: its base model
        state={"enum": ["ready", "loading", "at_zero"]},
        ready_instances=_INT,
        loading_instances=_INT,
    ),
    "ModelList": _obj(
        ["object", "data"], object={"const": "list"}, data={"type": "array", "items": _ref("Model")}
    ),
    "File": _obj(
        ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
        id=_STR,
        object={"const": "file"},
        bytes=_INT,
        created_at=_INT,
        filename=_STR,
        purpose=_STR,
        status=_STR,
        status_details=_NULL_STR,
    ),
    "FileList": _obj(
        ["object", "data", "has_more"],
        object={"const": "list"},
        data={"type": "array", "items": _ref("File")},
        has_more={"type": "boolean"},
        first_id=_NULL_STR,
        last_id=_NULL_STR,
    ),
    "FileDeleted": _obj(
        ["id", "object", "deleted"], id=_STR, object={"const": "file"}, deleted={"type": "boolean"}
    ),
    "FileUpload": _obj(
        ["purpose", "file"],
        purpose={"type": "string", "enum": ["fine-tune"]},
        file={
            "type": "string",
            "contentMediaType": "application/octet-stream",
            "description": 'Chat-format JSONL: one `{"messages": [...]}` object a line, each '
            "with an assistant message.",
        },
    ),
    # One server-sent event (OpenAPI 3.1 has a text/event-stream schema describe each event).
    "ServerSentEvent": {
        **_obj(["data"], data=_STR, event=_STR, id=_STR, retry=_INT),
        "description": "`data` holds a chunk as JSON (a chat.completion.chunk, or a "
        "text_completion without usage), an error object after the stream started, or the "
        "final `[DONE]`.",
    },
    "Health": _obj(
        ["status", "models", "task_executors", "job_executors"],
        status={"enum": ["ok", "starting"]},
        models={"type": "array", "items": _STR},
        task_executors={"type": "array", "items": {"type": "object"}},
        job_executors=_INT,
    ),
}

_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}

# Why each error status is sent; the body is always the OpenAI error object.
_ERRORS = {
    "400": "The request is malformed or asks for something unsupported (`param` names the field).",
    "401": "The API key is missing or wrong (when authentication is on).",
    "404": "No such model, file (or one of another tenant), or route.",
    "405": "The route does not take this method.",
    "413": "The request body exceeds the frontend's size limit.",
    "429": "A rate or concurrency limit was reached; retry after `Retry-After` seconds.",
    "503": "No capacity to serve the request within its deadline; retry after `Retry-After`.",
}


def _errors(*statuses: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in statuses:
        r: dict[str, Any] = {
            "description": _ERRORS[s],
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        if s in ("429", "503"):
            r["headers"] = _RETRY_AFTER
        out[s] = r
    return out


def _generation(summary: str, op_id: str, request: str, response: str) -> dict[str, Any]:
    return {
        "post": {
            "operationId": op_id,
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "The generated text: one JSON object, or server-sent events "
                    "(`data: {chunk}` lines ending with `data: [DONE]`) when `stream` is true.",
                    "content": {
                        "application/json": {"schema": _ref(response)},
                        "text/event-stream": {"schema": _ref("ServerSentEvent")},
                    },
                },
                **_errors("400", "401", "404", "405", "413", "429", "503"),
            },
        }
    }


def document(max_body_bytes: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 description of the frontend's HTTP API."""
    _, requests = msgspec.json.schema_components(
        (ChatCompletionRequest, CompletionRequest, JobRequest), ref_template=REF
    )
    limit = f" Bodies over {max_body_bytes} bytes get 413." if max_body_bytes else ""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "meshserve",
            "version": "1",
            "description": "The OpenAI-compatible API of a meshserve frontend." + limit,
        },
        "paths": {
            "/v1/chat/completions": _generation(
                "Create a chat completion",
                "createChatCompletion",
                "ChatCompletionRequest",
                "ChatCompletion",
            ),
            "/v1/completions": _generation(
                "Create a completion", "createCompletion", "CompletionRequest", "Completion"
            ),
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "summary": "List the models",
                    "security": [{"bearer": []}],
                    "responses": {
                        "200": _json("The models the cluster serves.", "ModelList"),
                        **_errors("401", "429"),
                    },
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "operationId": "retrieveModel",
                    "summary": "Describe one model",
                    "security": [{"bearer": []}],
                    "parameters": [
                        {"name": "model", "in": "path", "required": True, "schema": _STR}
                    ],
                    "responses": {
                        "200": _json("The model.", "Model"),
                        **_errors("401", "404", "429"),
                    },
                }
            },
            **_files(),
            **_fine_tuning(),
            "/health": {
                "get": {
                    "operationId": "health",
                    "summary": "Whether the frontend is connected and what the cluster runs",
                    "security": [],
                    "responses": {
                        "200": _json("Connected, with the cluster's view.", "Health"),
                        "503": _json("Still starting (no cluster view yet).", "Health"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus metrics",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "The Prometheus text exposition format.",
                            "content": {"text/plain": {"schema": _STR}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": {**requests, **_RESPONSES, **_FINE_TUNING_RESPONSES},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


_FILE_ID = [{"name": "file_id", "in": "path", "required": True, "schema": _STR}]


def _files() -> dict[str, Any]:
    """The Files API (``services/frontend/files.py``): a tenant's own files only."""
    bearer: list[dict[str, list[str]]] = [{"bearer": []}]
    return {
        "/v1/files": {
            "post": {
                "operationId": "createFile",
                "summary": "Upload a file (fine-tuning data)",
                "security": bearer,
                "requestBody": {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": _ref("FileUpload")}},
                },
                "responses": {
                    "200": _json("The file, stored.", "File"),
                    **_errors("400", "401", "413", "503"),
                },
            },
            "get": {
                "operationId": "listFiles",
                "summary": "List the caller's files",
                "security": bearer,
                "parameters": [
                    {"name": "purpose", "in": "query", "required": False, "schema": _STR},
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1},
                    },
                    {
                        "name": "order",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["asc", "desc"]},
                    },
                    {"name": "after", "in": "query", "required": False, "schema": _STR},
                ],
                "responses": {
                    "200": _json("The files, newest first by default.", "FileList"),
                    **_errors("400", "401", "503"),
                },
            },
        },
        "/v1/files/{file_id}": {
            "get": {
                "operationId": "retrieveFile",
                "summary": "Describe one file",
                "security": bearer,
                "parameters": _FILE_ID,
                "responses": {
                    "200": _json("The file.", "File"),
                    **_errors("401", "404", "503"),
                },
            },
            "delete": {
                "operationId": "deleteFile",
                "summary": "Delete a file",
                "security": bearer,
                "parameters": _FILE_ID,
                "responses": {
                    "200": _json("The file is gone.", "FileDeleted"),
                    **_errors("401", "404", "503"),
                },
            },
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "operationId": "downloadFile",
                "summary": "A file's bytes",
                "security": bearer,
                "parameters": _FILE_ID,
                "responses": {
                    "200": {
                        "description": "The file as uploaded.",
                        "content": {"application/octet-stream": {"schema": _STR}},
                    },
                    **_errors("401", "404", "503"),
                },
            }
        },
    }


_NUM = {"type": "number"}
_NULL_INT = {"type": ["integer", "null"]}
_AUTO_OR = {"anyOf": [{"const": "auto"}, _NUM]}


def _list_of(item: str) -> dict[str, Any]:
    return _obj(
        ["object", "data", "has_more"],
        object={"const": "list"},
        data={"type": "array", "items": _ref(item)},
        has_more={"type": "boolean"},
        first_id=_STR,
        last_id=_STR,
    )


_FINE_TUNING_RESPONSES: dict[str, Any] = {
    "FineTuningJob": _obj(
        ["id", "object", "created_at", "model", "status", "training_file", "hyperparameters"],
        id=_STR,
        object={"const": "fine_tuning.job"},
        created_at=_INT,
        model=_STR,
        status={
            "enum": ["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
        },
        fine_tuned_model=_NULL_STR,
        finished_at=_NULL_INT,
        trained_tokens=_NULL_INT,
        training_file=_STR,
        validation_file=_NULL_STR,
        organization_id=_STR,
        seed=_INT,
        suffix=_NULL_STR,
        hyperparameters=_obj(
            [], n_epochs=_AUTO_OR, batch_size=_AUTO_OR, learning_rate_multiplier=_AUTO_OR
        ),
        error={"anyOf": [{"type": "null"}, _obj(["code", "message"], code=_STR, message=_STR)]},
        metadata={"type": ["object", "null"], "additionalProperties": _STR},
    ),
    "FineTuningJobList": _list_of("FineTuningJob"),
    "FineTuningJobEvent": _obj(
        ["id", "object", "created_at", "level", "message"],
        id=_STR,
        object={"const": "fine_tuning.job.event"},
        created_at=_INT,
        level={"enum": ["info", "warn", "error"]},
        message=_STR,
        type={"enum": ["message", "metrics"]},
        data={"type": ["object", "null"]},
    ),
    "FineTuningJobEventList": _list_of("FineTuningJobEvent"),
    "FineTuningJobCheckpoint": _obj(
        ["id", "object", "created_at", "fine_tuning_job_id", "step_number", "metrics"],
        id=_STR,
        object={"const": "fine_tuning.job.checkpoint"},
        created_at=_INT,
        fine_tuned_model_checkpoint=_STR,
        fine_tuning_job_id=_STR,
        step_number=_INT,
        metrics={"type": "object", "additionalProperties": _NUM},
    ),
    "FineTuningJobCheckpointList": _list_of("FineTuningJobCheckpoint"),
}
_JOB_ID = [{"name": "job_id", "in": "path", "required": True, "schema": _STR}]
_PAGE = [
    {"name": "after", "in": "query", "required": False, "schema": _STR},
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
    },
]


def _fine_tuning() -> dict[str, Any]:
    """The fine-tuning API (``services/frontend/fine_tuning.py``): a tenant's own jobs only."""
    bearer: list[dict[str, list[str]]] = [{"bearer": []}]

    def get(op: str, summary: str, params: list[Any], schema: str, what: str) -> dict[str, Any]:
        return {
            "get": {
                "operationId": op,
                "summary": summary,
                "security": bearer,
                "parameters": params,
                "responses": {"200": _json(what, schema), **_errors("400", "401", "404", "503")},
            }
        }

    root = get(
        "listFineTuningJobs",
        "List the caller's fine-tuning jobs",
        _PAGE,
        "FineTuningJobList",
        "The jobs, newest first.",
    )
    root["post"] = {
        "operationId": "createFineTuningJob",
        "summary": "Create a fine-tuning job (LoRA, supervised)",
        "security": bearer,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref("JobRequest")}},
        },
        "responses": {
            "200": _json("The job, validating its files.", "FineTuningJob"),
            **_errors("400", "401", "404", "413", "503"),
        },
    }
    cancel = {
        "post": {
            "operationId": "cancelFineTuningJob",
            "summary": "Cancel a fine-tuning job",
            "security": bearer,
            "parameters": _JOB_ID,
            "responses": {
                "200": _json("The job, cancelled.", "FineTuningJob"),
                **_errors("400", "401", "404", "503"),
            },
        }
    }
    return {
        "/v1/fine_tuning/jobs": root,
        "/v1/fine_tuning/jobs/{job_id}": get(
            "retrieveFineTuningJob",
            "Describe a fine-tuning job",
            _JOB_ID,
            "FineTuningJob",
            "The job.",
        ),
        "/v1/fine_tuning/jobs/{job_id}/cancel": cancel,
        "/v1/fine_tuning/jobs/{job_id}/events": get(
            "listFineTuningEvents",
            "A job's events",
            _JOB_ID + _PAGE,
            "FineTuningJobEventList",
            "The events, newest first.",
        ),
        "/v1/fine_tuning/jobs/{job_id}/checkpoints": get(
            "listFineTuningCheckpoints",
            "A job's checkpoints (one per epoch)",
            _JOB_ID + _PAGE,
            "FineTuningJobCheckpointList",
            "The checkpoints, newest first.",
        ),
    }


def _json(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}
