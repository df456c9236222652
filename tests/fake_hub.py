"""A Hub on 127.0.0.1 speaking the few endpoints an upload uses (repo info, repo creation, preupload, commit), so
publishing is tested at the wire: what huggingface_hub really sends, not what a replaced method received. Every
request is recorded (method, path, headers, body); uploaded files are kept per repository."""

from __future__ import annotations

import base64
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml


@dataclass
class Repo:
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                hub.handle(self, "GET")

            def do_POST(self):
                hub.handle(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def handle(self, handler: BaseHTTPRequestHandler, method: str):
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        self.requests.append(Request(method, handler.path, dict(handler.headers), body))
        path = handler.path.split("?")[0]
        status, payload, headers = self.route(method, path, body)
        data = json.dumps(payload).encode()
        handler.send_response(status)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
            handler.send_header(key, value)
        handler.end_headers()
        handler.wfile.write(data)

    def route(self, method: str, path: str, body: bytes):
        not_found = (404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        if method == "POST" and path == "/api/repos/create":
            request = json.loads(body)
            repo_id = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": self.url(repo_id)}, {}
            # huggingface_hub 2.x sends "visibility"; earlier clients sent "private"; neither: public
            self.repos[repo_id] = Repo(private=request.get("visibility", "private" if request.get("private") else
                                                           "public") != "public")
            return 200, {"url": self.url(repo_id), "name": repo_id}, {}
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            repo = self.repos.get(match[1])
            if method != "GET" or repo is None:
                return not_found
            return 200, {"id": match[1], "private": repo.private, "sha": "0" * 40,
                         "visibility": "private" if repo.private else "public",
                         "siblings": [{"rfilename": name} for name in repo.files]}, {}
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/[^/]+", path):
            if match[1] not in self.repos:
                return not_found
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                   for f in files]}, {}
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/[^/]+", path):
            repo = self.repos.get(match[1])
            if repo is None:
                return not_found
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    repo.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return 200, {"commitUrl": f"{self.url(match[1])}/commit/{'1' * 40}", "commitOid": "1" * 40,
                         "pullRequestUrl": None}, {}
        if method == "POST" and path == "/api/validate-yaml":  # a README.md's front matter, before the commit
            content = json.loads(body)["content"]
            try:
                yaml.safe_load(content.split("---")[1]) if content.startswith("---") else None
            except yaml.YAMLError as err:
                return 400, {"error": f"Invalid metadata in README.md: {err}"}, {}
            return 200, {"errors": [], "warnings": []}, {}
        return 404, {"error": f"the fake Hub has no {method} {path}"}, {}

    def url(self, repo_id: str) -> str:
        return f"{self.endpoint}/{repo_id}"
