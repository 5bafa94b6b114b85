"""`flexmarl serve RUN_DIR`: every agent of a run behind one OpenAI-compatible HTTP server.

- `agents`: what a run folder holds for each agent (weights, tokenizer, version) and loading it;
- `worker`: one engine thread per agent feeding the continuous batch, with versioned engines so
  a hot reload never mixes two versions inside one request;
- `protocol`: request validation (clear 4xx errors) and OpenAI-shaped responses;
- `episodes`: one episode of the run's graph with the served agents;
- `capture`: durable SQLite capture of interactions, feedback, and which rows were trained on;
- `deploy`: the triple buffer per agent (shadow / training / canary), events, snapshots,
  heartbeats;
- `online`: the training policy learning from captured rows (truncated importance weights,
  KL bound to the shadow);
- `compress`: FP16 + zstd weight blobs for publishing across processes;
- `app`: the FastAPI application and `serve()`.

See docs/serving.md.
"""
