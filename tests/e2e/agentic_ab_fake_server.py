"""A stand-in server for tests/e2e/test_agentic_ab.py: stdlib only, instant answers.

    python tests/e2e/agentic_ab_fake_server.py --port N [--fail-after K] [--record FILE]

GET /health and /v1/models answer as Infernix does. POST /v1/chat/completions streams a short
answer: a tool call (`fake-call-<n>`) when the request has tools and an even seed, else text;
its usage has no cached-token details (the harness must count that as 0). After K successful
POSTs every POST gets a 500. --record appends each request's messages (roles, tool-call ids)
as one JSON line, so the test can check what the client sent.
"""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Lock


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail-after", type=int, default=None)
    parser.add_argument("--record", default=None)
    args = parser.parse_args()
    lock, served = Lock(), [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_):  # quiet: serve.log only needs errors
            pass

        def reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.reply(200, {"status": "ok"})
            else:
                self.reply(200, {"object": "list", "data": [{"id": "fake", "object": "model",
                                                             "max_model_len": 8192}]})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                served[0] += 1
                number = served[0]
                if args.record:
                    with open(args.record, "a") as record:
                        record.write(json.dumps({
                            "tag": self.headers.get("x-request-tag"),
                            "messages": [{"role": m["role"], "calls": [c["id"] for c in
                                                                       m.get("tool_calls", [])],
                                          "call_id": m.get("tool_call_id")}
                                         for m in request["messages"]]}) + "\n")
            if args.fail_after is not None and number > args.fail_after:
                self.reply(500, {"error": {"message": "fake failure", "type": "server_error"}})
                return
            if request.get("tools") and request["seed"] % 2 == 0:
                delta = {"tool_calls": [{"index": 0, "id": f"fake-call-{number}",
                                         "type": "function", "function": {
                                             "name": "read_file",
                                             "arguments": '{"path": "README.md"}'}}]}
                finish = "tool_calls"
            else:
                delta, finish = {"content": "done"}, "stop"
            chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                      {"choices": [{"index": 0, "delta": delta}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                      {"choices": [], "usage": {"prompt_tokens": len(json.dumps(request)) // 4,
                                                "completion_tokens": 3}}]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
