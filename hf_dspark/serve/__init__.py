"""`hf-dspark serve`: an OpenAI-compatible HTTP server on the speculative engine (FastAPI + uvicorn, the stack of
`transformers serve`; install with `pip install 'hf-dspark[serve]'`).

* `worker`: the engine thread, which alone steps the `SpeculativeEngine`; the event loop hands it work through
  thread-safe queues and never waits on a step.
* `text`: a choice's text as its tokens arrive, stop strings cut exactly (never sent, even across chunks).
* `protocol`: the request fields taken, checked, and OpenAI-shaped errors naming the field at fault.
* `generation`, `responses`, `app`: one request's choices, OpenAI's response objects and SSE, the routes.
* `metrics`: `/metrics` under vLLM's names. `server`: assembling and running it (graceful SIGTERM).

```python
from hf_dspark.serve import build_state, bind_socket, run
state = build_state(target, tokenizer, drafter, model_name="my-model")
run(state, bind_socket("127.0.0.1", 8000))
```
"""

from .server import bind_socket, build_state, run, uvicorn_server

__all__ = ["bind_socket", "build_state", "run", "uvicorn_server"]
