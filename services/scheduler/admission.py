"""Whether a submitted request may join the waiting queue, and the error when not."""

from __future__ import annotations

from spillway.shared.protocol import ErrorInfo, SubmitRequest, WorkerInfo

NOT_IN_A_SUBJECT_TOKEN = frozenset(".*> \t\r\n")


def invalid_request(message: str, code: str | None = None, param: str | None = None) -> ErrorInfo:
    return ErrorInfo(
        status=400, message=message, type="invalid_request_error", code=code, param=param
    )


def admission_error(
    req: SubmitRequest,
    worker: WorkerInfo | None,
    num_waiting: int,
    max_waiting: int,
    is_known_id: bool,
) -> ErrorInfo | None:
    """None when the request may wait for its turn. Checks run cheapest-first and from
    the caller's fault to ours: bad input (400), no worker (503), too long for the worker
    (400), queue full (429)."""
    prompt_len = len(req.prompt_token_ids)
    if prompt_len == 0:
        return invalid_request("the prompt is empty", param="prompt")
    if req.max_tokens is not None and req.max_tokens < 1:
        return invalid_request("max_tokens must be at least 1", param="max_tokens")
    if not req.gateway_id or any(c in NOT_IN_A_SUBJECT_TOKEN for c in req.gateway_id):
        # It names the subject the deltas go to.
        return invalid_request(f"gateway id {req.gateway_id!r} is not a subject token")
    if is_known_id:
        return invalid_request(f"request id {req.request_id!r} is already in use")
    if worker is None:
        return ErrorInfo(status=503, message="no worker available", code="no_worker")
    if any(t < 0 or t >= worker.vocab_size for t in req.prompt_token_ids):
        return invalid_request(
            f"prompt token ids must lie in [0, {worker.vocab_size})", param="prompt"
        )
    if any(t < 0 or t >= worker.vocab_size for t in req.output_token_ids):
        return invalid_request(f"output token ids must lie in [0, {worker.vocab_size})")
    if req.max_tokens is not None and len(req.output_token_ids) >= req.max_tokens:
        return invalid_request("a resumed request has no tokens left to generate")
    # A resumed request's tokens so far occupy the context like its prompt.
    prompt_len += len(req.output_token_ids)
    # One generated token must fit as well: its KV is written by the first decode step.
    if prompt_len >= worker.max_model_len:
        return invalid_request(
            f"the prompt has {prompt_len} tokens; this model's context is "
            f"{worker.max_model_len} tokens, which leaves no room to generate",
            code="context_length_exceeded",
            param="messages",
        )
    kv_capacity = worker.num_kv_blocks * worker.block_size
    if prompt_len + 1 > kv_capacity:
        return invalid_request(
            f"the prompt has {prompt_len} tokens; the KV cache holds {kv_capacity}",
            code="context_length_exceeded",
            param="messages",
        )
    if num_waiting >= max_waiting:
        return ErrorInfo(
            status=429,
            message=f"the admission queue is full ({max_waiting} requests waiting)",
            type="rate_limit_error",
            code="queue_full",
        )
    return None
