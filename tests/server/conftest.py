"""Live servers on loopback for the HTTP tests (uvicorn in a background thread)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from specserve import LLM
from specserve.server.app import OpenAIServer, build_app
from specserve.server.lifecycle import DrainingServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A running server: base URL plus the engine behind it."""

    def __init__(self, server: OpenAIServer, port: int, thread: threading.Thread, uv) -> None:  # noqa: ANN001
        self.server = server
        self.engine = server.engine
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.thread = thread
        self.uv = uv

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is in flight."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.server.async_engine.num_in_flight == 0 and not self.engine.has_unfinished_requests():
                return
            time.sleep(0.05)
        raise TimeoutError("server did not go idle")


@contextlib.contextmanager
def serve(llm: LLM, name: str = "smollm2", **kw) -> Iterator[LiveServer]:  # noqa: ANN003
    import uvicorn

    server = OpenAIServer(llm.engine, name, **kw)
    app = build_app(server)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    uv = DrainingServer(config, server)  # uv.handle_exit(SIGTERM, None) drains as a signal would
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("server failed to start")
        time.sleep(0.02)
    try:
        yield LiveServer(server, port, thread, uv)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def smol_server(smollm_checkpoint):
    """SmolLM2 (fp32) behind a live server, shared by the client tests."""
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, max_num_seqs=48,
              spec_method="ngram", spec_policy="adaptive", profile_spec_costs=False)
    with serve(llm, "smollm2") as live:
        yield live


@pytest.fixture(scope="session")
def tiny_tok_checkpoint(smollm_checkpoint):
    """A tiny random Llama that uses SmolLM2's tokenizer: text in, text out, milliseconds per token."""
    from specserve.models.loader import LoadedCheckpoint

    arch = dataclasses.replace(
        smollm_checkpoint.arch, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, tie_word_embeddings=True, name="tiny-smollm-vocab",
    )
    g = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(arch.vocab_size, 64, generator=g) * 0.3,
               "model.norm.weight": torch.ones(64)}
    for i in range(arch.num_layers):
        pre = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)),
                            ("self_attn.v_proj", (32, 64)), ("self_attn.o_proj", (64, 64)),
                            ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)), ("mlp.down_proj", (64, 128))]:
            weights[pre + name + ".weight"] = torch.randn(*shape, generator=g) * 0.1
        weights[pre + "input_layernorm.weight"] = torch.ones(64)
        weights[pre + "post_attention_layernorm.weight"] = torch.ones(64)
    return LoadedCheckpoint(arch, weights, smollm_checkpoint.tokenizer, "tiny-with-smollm2-tokenizer")
