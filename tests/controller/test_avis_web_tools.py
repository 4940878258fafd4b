"""AVIS's web tools over HTTP (issue 50, point 3): a knowledge file served on 127.0.0.1, searches recorded and
replayed by the LLM call cache, failures as tool outputs, bad replies as one error naming the URL."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from clova_train.envs.avis.agents import AgentSpec
from clova_train.envs.avis.information_seeking import InformationSeekingConfig, InformationSeekingEnv
from clova_train.envs.avis.world import GOOD_PATHS, write_knowledge_file
from clova_train.llm.backends import BackendError
from clova_train.llm.cache import ReplayMiss
from clova_train.llm.knowledge_server import KnowledgeServer, load_knowledge
from clova_train.llm.search import HttpSearchBackend, WebSearchConfig

SEEDS = (0, 1, 2, 3, 4, 5)


def play(env: InformationSeekingEnv, seeds=SEEDS) -> list[tuple]:
    """Each seed's episode along the good path of its question's kind: (answer, total reward, path)."""
    played = []
    for seed in seeds:
        env.reset(seed=seed)
        total, info, done = 0.0, {}, False
        for action in GOOD_PATHS[env.task.question_type]:
            if done:
                break
            _, reward, terminated, truncated, info = env.step(env.graph.index(action))
            total, done = total + reward, terminated or truncated
        played.append((info.get("answer"), total, [{k: v for k, v in e.items() if k != "tool_error"}
                                                   for e in info.get("path", [])]))
    return played


def web_config(server: KnowledgeServer, **fields) -> InformationSeekingConfig:
    web = WebSearchConfig(server.url("image_search"), server.url("text_search"), max_retries=0, timeout_s=5.0)
    return InformationSeekingConfig(**{"kinds": ["entity", "fact"], **fields}, web=web)


@pytest.fixture()
def server(tmp_path):
    with KnowledgeServer(load_knowledge(write_knowledge_file(tmp_path / "knowledge.json"))) as running:
        yield running


def test_served_knowledge_answers_as_offline_and_replays_without_http(tmp_path, server):
    cache = str(tmp_path / "calls.sqlite")
    env = InformationSeekingEnv(web_config(server, cache_path=cache))
    recorded = play(env)
    env.close()
    offline = play(InformationSeekingEnv(InformationSeekingConfig(kinds=["entity", "fact"])))
    assert recorded == offline
    outputs = [e["output"] for _, _, path in recorded for e in path]
    assert any(o.startswith("similar images: emblem of") for o in outputs)
    assert any(o.startswith("web: ") and "founded in" in o for o in outputs)
    assert any(answer is not None and reward > 0 for answer, reward, _ in recorded)
    assert server.requests > 0

    server.stop()
    replaying = InformationSeekingEnv(web_config(server, cache_path=cache, cache_mode="replay"))
    assert play(replaying) == recorded
    assert replaying.web.search.backend.requests == 0 and replaying.cache.stats.backend_calls == 0

    moved = WebSearchConfig("http://127.0.0.1:9/image_search", "http://127.0.0.1:9/text_search", max_retries=0)
    other = InformationSeekingEnv(InformationSeekingConfig(kinds=["entity", "fact"], web=moved, cache_path=cache,
                                                           cache_mode="replay"))
    with pytest.raises(ReplayMiss, match="http-search"):
        play(other)


def via_entity_agent(env: InformationSeekingEnv) -> list[tuple]:
    """The first three seeds' steps along ``agent:entity`` then ``text_search``: (reward, answer, the step's output)."""
    steps = []
    for seed in SEEDS[:3]:
        env.reset(seed=seed)
        for action in ("agent:entity", "text_search"):
            _, reward, terminated, truncated, info = env.step(env.graph.index(action))
            steps.append((reward, info["answer"], info["path"][-1]["output"]))
            if terminated or truncated:
                break
    return steps


def test_called_agents_share_the_web_tools_and_replay(tmp_path, server):
    entity = AgentSpec("entity", graph="avis", tools=["detect", "select", "image_search"], policy="scripted",
                       path=["detect", "select", "image_search"])
    fields = {"graph": str(Path(__file__).resolve().parents[2] / "envs/graphs/fact_via_agent.yaml"), "kinds": ["fact"], "agents": [entity]}
    cache = str(tmp_path / "calls.sqlite")
    env = InformationSeekingEnv(web_config(server, cache_path=cache, **fields))
    before = server.requests
    steps = via_entity_agent(env)
    assert server.requests - before >= 2  # the agent's image_search and the caller's text_search
    again = via_entity_agent(InformationSeekingEnv(InformationSeekingConfig(**fields)))
    assert steps == again and any(reward > 0 for reward, _, _ in steps)

    moved = WebSearchConfig("http://127.0.0.1:9/image_search", server.url("text_search"), max_retries=0)
    other = InformationSeekingEnv(InformationSeekingConfig(**fields, web=moved, cache_path=cache, cache_mode="replay"))
    other.reset(seed=SEEDS[0])
    with pytest.raises(ReplayMiss, match="http-search"):  # inside the called agent, still a configuration error
        other.step(other.graph.index("agent:entity"))


def test_stopped_server_is_a_failed_tool_not_an_exception(tmp_path, server):
    config = web_config(server, cache_path=str(tmp_path / "calls.sqlite"))
    server.stop()
    env = InformationSeekingEnv(config)
    errors = []
    for seed in SEEDS:
        env.reset(seed=seed)
        done = False
        for action in GOOD_PATHS[env.task.question_type]:
            if done:
                break
            _, _, terminated, truncated, info = env.step(env.graph.index(action))
            done = terminated or truncated
            if info["tool_error"]:
                errors.append((info["path"][-1], info["tool_error"]))
    assert errors
    event, error = errors[0]
    assert event["action"] == "image_search" and event["output"].startswith("failed: ")
    assert event["result"] == "uninformative" and server.url("image_search") in error
    stored = env.cache.connection.execute("SELECT COUNT(*) FROM calls WHERE request LIKE '%http-search%'").fetchone()
    assert stored == (0,)  # a failed search is not recorded: a later run may succeed


class _Bad(BaseHTTPRequestHandler):
    replies = {
        "/html": (200, "text/html", b"<html><body>search</body></html>"),
        "/huge": (200, "application/json", b'{"results": ["' + b"x" * 5000 + b'"]}'),
        "/streamed": (200, "application/json", b'{"results": ["' + b"x" * 50000 + b'"]}'),
        "/shape": (200, "application/json", b'{"hits": ["a"]}'),
        "/items": (200, "application/json", b'{"results": [1, 2]}'),
        "/list": (200, "application/json", b'["a"]'),
        "/latin1": (200, "application/json", '{"results": ["caf\u00e9"]}'.encode("latin-1")),
        "/missing": (404, "text/plain", b"not here"),
        "/busy": (503, "text/plain", b"busy"),
        "/ok": (200, "application/json", b'{"results": ["  first\\nresult ", "second"]}'),
        "/none": (200, "application/json", b'{"results": []}'),
    }
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        self.seen.append(path)
        if path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.example/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status, kind, body = self.replies[path]
        self.send_response(status)
        self.send_header("Content-Type", kind)
        if path != "/streamed":  # no length: read until the server closes (HTTP/1.0)
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def bad_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Bad)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("path, why", [("/html", "malformed search reply"),
                                       ("/huge", "5,017 bytes, more than the 1,000"),
                                       ("/streamed", "larger than the 1,000 bytes"),
                                       ("/shape", '"results"'), ("/items", '"results"'), ("/list", '"results"'),
                                       ("/latin1", "UTF-8"), ("/missing", "HTTP 404"), ("/moved", "redirect"),
                                       ("/busy", "after 2 attempts")])
def test_bad_reply_is_one_error_naming_the_url(bad_server, path, why):
    url = bad_server + path
    backend = HttpSearchBackend(url, None, max_retries=1, backoff_s=0.01, max_reply_bytes=1000)
    _Bad.seen.clear()
    with pytest.raises(BackendError, match=why) as caught:
        backend.search("image_search", "red circle")
    assert url in str(caught.value)
    assert _Bad.seen == [path] * (2 if path == "/busy" else 1)  # only retryable failures are tried again


def test_good_replies_and_config_checks(bad_server):
    assert HttpSearchBackend(bad_server + "/ok").search("image_search", "q") == "first result"
    assert HttpSearchBackend(bad_server + "/none").search("image_search", "q") == "no results"
    with pytest.raises(BackendError, match="no URL is configured for text_search"):
        HttpSearchBackend(bad_server + "/ok").search("text_search", "q")

    config = InformationSeekingConfig(web={"image_search_url": "ftp://x/y", "timeout_s": 0})
    assert isinstance(config.web, WebSearchConfig)
    problems = config.problems("env")
    assert any(p.startswith("env.web.image_search_url = 'ftp://x/y'") for p in problems)
    assert any(p.startswith("env.web.timeout_s = 0") for p in problems)
    assert InformationSeekingConfig().problems() == []
    assert InformationSeekingEnv(InformationSeekingConfig()).web is None
    assert json.loads(json.dumps(InformationSeekingEnv(InformationSeekingConfig()).describe()["config"]["web"])) == {
        "image_search_url": None, "text_search_url": None, "api_key_env": "", "timeout_s": 10.0, "max_retries": 2}


def test_hammr_agents_search_through_the_dispatchers_web_tools(tmp_path, server):
    from clova_train.envs.hammr.dispatch import AgentDispatchConfig, AgentDispatchEnv

    web = WebSearchConfig(server.url("image_search"), server.url("text_search"), max_retries=0, timeout_s=5.0)
    config = AgentDispatchConfig(kinds=["entity", "fact"], web=web, cache_path=str(tmp_path / "calls.sqlite"))
    assert config.problems("hammr") == []
    env = AgentDispatchEnv(config)
    offline = AgentDispatchEnv(AgentDispatchConfig(kinds=["entity", "fact"]))
    served, local = [], []
    for seed in SEEDS[:3]:
        for target, played in ((env, served), (offline, local)):
            target.reset(seed=seed)
            _, reward, _, _, info = target.step(target.suggested_index())
            played.append((reward, info["answer"]))
    env.close()
    assert served == local and server.requests > 0  # the agents' searches went over HTTP and answered as offline
    bad = AgentDispatchConfig(web=WebSearchConfig("ftp://x", None))
    assert any(p.startswith("hammr.web") for p in bad.problems("hammr")), bad.problems("hammr")
