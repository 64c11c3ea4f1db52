"""The broker's configuration file: every rule, with its message (file, key, rule, fix)."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx.broker.config import (
    BrokerConfig,
    BrokerConfigError,
    Problem,
    load_config,
    render_config,
)

FILES = ("tls.crt", "tls.key", "ca.crt", "sa-token", "router-token", "kubeconfig")
SECRET = "s3cr3t-value-that-must-never-show"
JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl"

SERVER = """\
[server]
listen = "0.0.0.0:8443"
public_url = "https://sandbox-broker.example.com"
tls_cert_file = "tls.crt"
tls_key_file = "tls.key"
"""
ISSUER = """\
[[issuers]]
name = "cluster"
url = "https://kubernetes.default.svc.cluster.local"
provider = "kubernetes"
ca_file = "ca.crt"
token_file = "sa-token"
"""
POLICY = """\
[[policies]]
name = "team-a"
issuer = "cluster"
warm_pools = ["python-sandbox-warmpool"]
namespace = "team-a"
"""
BACKEND = """\
[backend]
kind = "kubernetes"

[backend.kubernetes]
router_url = "http://sandbox-router-svc.agent-sandbox-system.svc.cluster.local:8080"
router_token_file = "router-token"
"""


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    """A directory with the files a configuration names (each holding a secret-looking text)."""
    for name in FILES:
        (tmp_path / name).write_text(f"{SECRET}-{name}\n")
    return tmp_path


def write(directory: Path, *parts: str, name: str = "broker.toml") -> Path:
    path = directory / name
    path.write_text("\n".join(parts))
    return path


def load(directory: Path, *parts: str) -> BrokerConfig:
    return load_config(write(directory, *parts))


def problems(directory: Path, *parts: str) -> list[Problem]:
    path = write(directory, *parts)
    with pytest.raises(BrokerConfigError) as info:
        load_config(path)
    error = info.value
    assert error.path == path
    assert isinstance(error, ValueError)
    for problem in error.problems:  # every line names the file, the key, the rule and the fix
        line = problem.line(path)
        assert line.startswith(f"{path}: ") and "; fix: " in line, line
        assert problem.rule and problem.fix
    assert str(error).count("\n") == len(error.problems)
    assert SECRET not in str(error) and JWT not in str(error)
    return list(error.problems)


def one(found: list[Problem], key: str, rule: str = "", fix: str = "") -> Problem:
    """The problem at ``key`` (its rule and fix contain ``rule`` and ``fix``)."""
    at = [p for p in found if p.key.split(" (")[0] == key]
    assert len(at) == 1, (key, found)
    assert rule in at[0].rule, at[0]
    assert fix in at[0].fix, at[0]
    return at[0]


def test_a_minimal_file_loads_with_the_defaults_filled_in(conf: Path) -> None:
    config = load(conf, SERVER, ISSUER, POLICY, BACKEND)
    assert config.path == conf / "broker.toml"
    server = config.server
    assert (server.host, server.port, server.listen) == ("0.0.0.0", 8443, "0.0.0.0:8443")
    assert server.tls_cert_file == conf / "tls.crt"
    assert (server.tls_reload_seconds, server.shutdown_grace_seconds) == (30.0, 30.0)
    assert server.protocols == ("v1", "rpc") and server.log_level == "info" and server.access_log
    [issuer] = config.issuers
    assert issuer.audiences == ("https://sandbox-broker.example.com",)
    assert issuer.algorithms == ("RS256",) and issuer.discovery and issuer.jwks_url is None
    assert issuer.verification == "jwks" and issuer.attributes is None
    assert issuer.token_file == conf / "sa-token" and issuer.ca_file == conf / "ca.crt"
    [policy] = config.policies
    assert (policy.subject, policy.max_sandboxes, policy.max_lifetime_seconds) == ("*", 5, 3600)
    assert policy.scopes == ("commands", "files") and dict(policy.claims) == {}
    kube = config.backend.kubernetes
    assert config.backend.kind == "kubernetes" and config.backend.local is None and kube
    assert (kube.connection, kube.data_plane, kube.runtime_port) == ("in-cluster", "router", 8888)
    assert kube.allow_loopback_pod_ips is False and kube.ready_timeout_seconds == 180.0
    assert "server.tls_reload_seconds" in config.defaulted
    assert "issuers[0].audiences" in config.defaulted
    assert "server.public_url" not in config.defaulted
    assert config.issuer("cluster") is issuer


def test_public_url_gets_the_clients_one_url_rule(conf: Path) -> None:
    server = SERVER.replace(
        "https://sandbox-broker.example.com", "https://Sandbox-Broker.EXAMPLE.com:443/"
    )
    config = load(conf, server, ISSUER, POLICY, BACKEND)
    # what the client sends tokens for (its broker URL's normal form): the default audience
    assert config.server.public_url == "https://sandbox-broker.example.com"
    assert config.issuers[0].audiences == ("https://sandbox-broker.example.com",)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://sandbox-broker.example.com", "not an absolute https:// URL"),
        ("https://user:pw@sandbox-broker.example.com", "user name or password"),
        ("https://sandbox-broker.example.com/?x=1", "query or fragment"),
        ("https://sandbox broker.example.com", "space or a control character"),
        ("https://a..b", "invalid host name"),
        ("https://sandbox-broker.example.com:99999", "does not parse"),
        ("sandbox-broker.example.com", "not an absolute https:// URL"),
    ],
)
def test_public_url_rules(conf: Path, url: str, rule: str) -> None:
    server = SERVER.replace("https://sandbox-broker.example.com", url)
    found = problems(conf, server, ISSUER, POLICY, BACKEND)
    problem = one(found, "server.public_url", rule, "public_url = ")
    assert "pw" not in problem.rule  # a password in a URL is never shown


def test_paths_are_relative_to_the_files_directory_and_expand_the_home(
    conf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the working directory: the configuration's
    backend = BACKEND.replace(
        "[backend.kubernetes]",
        '[backend.kubernetes]\nconnection = "kubeconfig"\nkubeconfig_file = "~/.kube/config"',
    )
    config = load(conf, SERVER.replace('"tls.crt"', '"./sub/../tls.crt"'), ISSUER, POLICY, backend)
    assert config.server.tls_cert_file == conf / "tls.crt"
    assert config.backend.kubernetes and config.backend.kubernetes.kubeconfig_file == (
        home / ".kube" / "config"
    )


def test_every_problem_is_reported_at_once(conf: Path) -> None:
    server = SERVER.replace('"0.0.0.0:8443"', '"0.0.0.0:http"') + "log_level = 'loud'\n"
    issuer = ISSUER.replace('provider = "kubernetes"', 'provider = "kubernetes"\nclock = 1')
    found = problems(
        conf,
        server,
        issuer,
        POLICY.replace('namespace = "team-a"', 'namespace = "Team A"'),
        BACKEND,
    )
    keys = [p.key.split(" (")[0] for p in found]
    assert keys == [
        "server.listen",
        "server.log_level",
        "issuers[0].clock",
        "policies[0].namespace",
    ]
    path = conf / "broker.toml"
    with pytest.raises(BrokerConfigError, match=r"has 4 problems:\n  ") as info:
        load_config(path)
    assert str(info.value).splitlines()[1].startswith(f"  {path}: server.listen: ")


def test_a_tables_name_is_shown_beside_its_keys(conf: Path) -> None:
    found = problems(conf, SERVER, ISSUER.replace("sa-token", "missing"), POLICY, BACKEND)
    assert one(found, "issuers[0].token_file").key == 'issuers[0].token_file (issuer "cluster")'


@pytest.mark.parametrize(
    ("part", "key", "fix"),
    [
        (SERVER + "listn = '0.0.0.0:1'\n", "server.listn", "did you mean 'listen'?"),
        (SERVER + "tls_reload_second = 1\n", "server.tls_reload_second", "'tls_reload_seconds'"),
        (SERVER + "[servr]\n", "servr", "did you mean 'server'?"),
        (SERVER + "zzz = 1\n", "server.zzz", "the keys of [server] are: listen, public_url"),
    ],
)
def test_unknown_keys_are_refused_with_did_you_mean(
    conf: Path, part: str, key: str, fix: str
) -> None:
    found = problems(conf, part, ISSUER, POLICY, BACKEND)
    one(found, key, "is not a key of", fix)


def test_unknown_keys_in_every_table(conf: Path) -> None:
    issuer = ISSUER + "verificaton = 'jwks'\n"
    policy = POLICY + "warm_pool = ['x']\n"
    backend = BACKEND.replace("[backend]\n", "[backend]\nknd = 1\n") + "data_plan = 'pod'\n"
    found = problems(conf, SERVER, issuer, policy, backend)
    one(found, "issuers[0].verificaton", fix="did you mean 'verification'?")
    one(found, "policies[0].warm_pool", fix="did you mean 'warm_pools'?")
    one(found, "backend.knd", fix="did you mean 'kind'?")
    one(found, "backend.kubernetes.data_plan", fix="did you mean 'data_plane'?")


@pytest.mark.parametrize(
    ("table", "line", "key", "fix"),
    [
        ("issuer", f'token = "{JWT}"', "issuers[0].token", "token_file = "),
        ("server", f'tls_key = "{SECRET}"', "server.tls_key", "tls_key_file = "),
        (
            "backend",
            f'router_token = "{SECRET}"',
            "backend.kubernetes.router_token",
            "router_token_file",
        ),
        ("server", f'password = "{SECRET}"', "server.password", "tls_cert_file, tls_key_file"),
        (
            "issuer",
            f'client_secret = "{SECRET}"',
            "issuers[0].client_secret",
            "ca_file, token_file",
        ),
        ("policy", f'api_key = "{SECRET}"', "policies[0].api_key", "this table takes no secret"),
    ],
)
def test_inline_secrets_are_refused_naming_the_file_key(
    conf: Path, table: str, line: str, key: str, fix: str
) -> None:
    parts = {"server": SERVER, "issuer": ISSUER, "policy": POLICY, "backend": BACKEND}
    parts[table] += line + "\n"
    found = problems(conf, *parts.values())  # (the secret never shows: see problems())
    problem = one(found, key, fix=fix)
    assert "never" in problem.rule


PEM_KEY_START = "-----BEGIN " + "PRIVATE KEY-----\\nMIIE"  # the start of one (no key in the repo)


@pytest.mark.parametrize("value", [JWT, PEM_KEY_START, "line one\\nline two"])
def test_a_secret_where_a_path_belongs_is_refused_without_showing_it(
    conf: Path, value: str
) -> None:
    issuer = ISSUER.replace('token_file = "sa-token"', f'token_file = "{value}"')
    found = problems(conf, SERVER, issuer, POLICY, BACKEND)
    problem = one(found, "issuers[0].token_file", "not a file's path", "token_file as that file")
    assert value.split("\\n")[0] not in str(problem)


def test_files_must_exist_and_be_files(conf: Path) -> None:
    (conf / "a-directory").mkdir()
    server = SERVER.replace('"tls.key"', '"a-directory"').replace('"tls.crt"', '"gone.crt"')
    found = problems(conf, server, ISSUER, POLICY, BACKEND.replace("router-token", "/no/such"))
    one(found, "server.tls_cert_file", f"'{conf / 'gone.crt'}' does not exist", "existing")
    one(found, "server.tls_key_file", f"'{conf / 'a-directory'}' is not a file")
    one(found, "backend.kubernetes.router_token_file", "'/no/such' does not exist")
    # another machine's file: checked without the files
    config = load_config(conf / "broker.toml", check_files=False)
    assert config.server.tls_cert_file == conf / "gone.crt"


def test_an_unreadable_file_is_named(conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = conf / "sa-token"
    token.chmod(0)
    if os.geteuid() == 0:  # root reads every file: the check asks os.access, as for anyone
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: p != token and real(p, mode))
    found = problems(conf, SERVER, ISSUER, POLICY, BACKEND)
    one(found, "issuers[0].token_file", "is not readable by this process", "readable")


def test_required_keys_and_tables(conf: Path) -> None:
    found = problems(conf, SERVER.replace('tls_key_file = "tls.key"\n', ""), BACKEND)
    one(found, "server.tls_key_file", "[server] has no 'tls_key_file', which is required")
    one(found, "issuers", "has no 'issuers'", "add a [[issuers]] table")
    one(found, "policies", "has no 'policies'")
    found = problems(conf, ISSUER, POLICY)
    one(found, "server", "the file has no [server] table", "public_url")
    one(found, "backend", "the file has no [backend] table", 'kind = "kubernetes"')


def test_wrong_types_name_the_toml_types(conf: Path) -> None:
    server = SERVER + 'shutdown_grace_seconds = true\ntls_reload_seconds = "30"\naccess_log = 1\n'
    found = problems(conf, server, ISSUER, POLICY + "max_sandboxes = 2.5\n", BACKEND)
    one(found, "server.shutdown_grace_seconds", "a number of seconds, not a boolean")
    one(found, "server.tls_reload_seconds", "a number of seconds, not a string")
    one(found, "server.access_log", "must be a boolean, not an integer")
    one(found, "policies[0].max_sandboxes", "must be a whole number, not a float")
    found = problems(conf, SERVER, "[issuers]\nname = 'x'\n", POLICY, BACKEND)
    one(found, "issuers", "must be an array of tables, not a table", "[[issuers]]")


@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [
        ("[::]:8443", "::", 8443),
        ("[::1]:0", "::1", 0),
        ("127.0.0.1:8443", "127.0.0.1", 8443),
        ("localhost:9000", "localhost", 9000),
    ],
)
def test_listen_forms(conf: Path, listen: str, host: str, port: int) -> None:
    config = load(conf, SERVER.replace("0.0.0.0:8443", listen), ISSUER, POLICY, BACKEND)
    assert (config.server.host, config.server.port, config.server.listen) == (host, port, listen)


@pytest.mark.parametrize(
    ("listen", "rule"),
    [
        ("::1:8443", "an IPv6 address needs brackets"),
        ("8443", "is not host:port"),
        (":8443", "is not host:port"),
        ("0.0.0.0:70000", "port 70000 is over 65535"),
        ("[nope]:8443", "'nope' is not an IPv6 address"),
    ],
)
def test_listen_rules(conf: Path, listen: str, rule: str) -> None:
    found = problems(conf, SERVER.replace("0.0.0.0:8443", listen), ISSUER, POLICY, BACKEND)
    one(found, "server.listen", rule, '"[::]:8443" (IPv6)')


def test_server_value_rules(conf: Path) -> None:
    server = SERVER + (
        'protocols = ["v1", "grpc"]\nlog_level = "infos"\ntls_reload_seconds = 0\n'
        "shutdown_grace_seconds = -1\nkeep_alive_seconds = nan\n"
    )
    found = problems(conf, server, ISSUER, POLICY, BACKEND)
    one(found, "server.protocols", "'grpc' is not a dialect the broker serves")
    one(found, "server.log_level", "'infos' is not one of 'critical'", "did you mean 'info'?")
    one(found, "server.tls_reload_seconds", "out of range", "> 0")
    one(found, "server.shutdown_grace_seconds", "out of range", ">= 0")
    one(found, "server.keep_alive_seconds", "out of range")
    found = problems(conf, SERVER + 'protocols = ["v1", "v1"]\n', ISSUER, POLICY, BACKEND)
    one(found, "server.protocols", "lists 'v1' twice")
    found = problems(conf, SERVER + "protocols = []\n", ISSUER, POLICY, BACKEND)
    one(found, "server.protocols", "is empty")


def test_issuer_rules(conf: Path) -> None:
    issuer = (
        ISSUER.replace('"cluster"', '"Cluster!"').replace(
            "https://kubernetes.default.svc.cluster.local", "http://kubernetes"
        )
        + 'algorithms = ["RS256", "HS256"]\nclock_skew_seconds = 3600\n'
    )
    found = problems(conf, SERVER, issuer, POLICY.replace('"cluster"', '"x"'), BACKEND)
    one(found, "issuers[0].name", "'Cluster!' is not a DNS-1123 label")
    one(found, "issuers[0].url", "not an absolute https:// URL", "exactly the tokens' iss")
    one(found, "issuers[0].algorithms", "'HS256' is never accepted", 'algorithms = ["RS256"]')
    one(found, "issuers[0].clock_skew_seconds", "out of range", "<= 300")


@pytest.mark.parametrize(
    ("algorithm", "rule"),
    [("none", "never accepted"), ("HS512", "never accepted"), ("RS1", "not a signature algo")],
)
def test_algorithms_are_asymmetric_only(conf: Path, algorithm: str, rule: str) -> None:
    issuer = ISSUER + f'algorithms = ["{algorithm}"]\n'
    one(problems(conf, SERVER, issuer, POLICY, BACKEND), "issuers[0].algorithms", rule)


def test_the_provider_name(conf: Path) -> None:
    typo = ISSUER.replace('provider = "kubernetes"', 'provider = "kubernets"')
    found = problems(conf, SERVER, typo, POLICY, BACKEND)
    one(found, "issuers[0].provider", "close to 'kubernetes'", "did you mean 'kubernetes'?")
    bad = ISSUER.replace('provider = "kubernetes"', 'provider = "My Provider"')
    one(problems(conf, SERVER, bad, POLICY, BACKEND), "issuers[0].provider", "not a provider")
    custom = ISSUER.replace('provider = "kubernetes"', 'provider = "keycloak"')
    assert load(conf, SERVER, custom, POLICY, BACKEND).issuers[0].provider == "keycloak"


def test_where_the_keys_come_from(conf: Path) -> None:
    explicit = ISSUER + 'jwks_url = "https://kubernetes.default.svc/openid/v1/jwks"\n'
    issuer = load(conf, SERVER, explicit, POLICY, BACKEND).issuers[0]
    assert issuer.jwks_url and issuer.discovery is False  # a jwks_url turns discovery off
    both = explicit + "discovery = true\n"
    one(problems(conf, SERVER, both, POLICY, BACKEND), "issuers[0].discovery", "both given")
    neither = ISSUER + "discovery = false\n"
    one(problems(conf, SERVER, neither, POLICY, BACKEND), "issuers[0].discovery", "no jwks_url")
    refetch = ISSUER + "jwks_cache_seconds = 10\njwks_min_refetch_seconds = 60\n"
    one(
        problems(conf, SERVER, refetch, POLICY, BACKEND),
        "issuers[0].jwks_min_refetch_seconds",
        "longer than jwks_cache_seconds (10)",
    )


def test_tokenreview_rules(conf: Path) -> None:
    review = ISSUER.replace('ca_file = "ca.crt"\ntoken_file = "sa-token"\n', "")
    review += 'verification = "tokenreview"\n'
    assert load(conf, SERVER, review, POLICY, BACKEND).issuers[0].verification == "tokenreview"
    gitlab = review.replace('"kubernetes"', '"gitlab"') + "discovery = true\n"
    found = problems(conf, SERVER, gitlab, POLICY, BACKEND)
    one(found, "issuers[0].verification", 'needs provider = "kubernetes"')
    one(found, "issuers[0].discovery", 'not used with verification = "tokenreview"')
    local = (
        '[backend]\nkind = "local"\n[backend.local]\ntemplates = { python-sandbox-warmpool = "" }\n'
    )
    found = problems(conf, SERVER, review, POLICY, local)
    one(found, "issuers[0].verification", "needs the Kubernetes API server")
    with_files = review + 'token_file = "sa-token"\n'
    one(problems(conf, SERVER, with_files, POLICY, BACKEND), "issuers[0].token_file", "not used")


def test_issuer_names_and_urls_are_unique(conf: Path) -> None:
    found = problems(conf, SERVER, ISSUER, ISSUER, POLICY, BACKEND)
    one(found, "issuers[1].name", "'cluster' is also the name of issuers[0]")
    one(found, "issuers[1].url", "is also the url of issuers[0]")


def test_policies_refer_to_issuers_by_name(conf: Path) -> None:
    found = problems(
        conf, SERVER, ISSUER, POLICY.replace('issuer = "cluster"', 'issuer = "clustr"'), BACKEND
    )
    one(
        found,
        "policies[0].issuer",
        "'clustr' is not the name of an [[issuers]] table ('cluster')",
        "did you mean 'cluster'?",
    )
    missing = POLICY.replace('issuer = "cluster"\n', "")
    one(problems(conf, SERVER, ISSUER, missing, BACKEND), "policies[0].issuer", "is required")


def test_the_namespace_and_its_one_placeholder(conf: Path) -> None:
    own = POLICY.replace('namespace = "team-a"', 'namespace = "{caller.namespace}"')
    assert load(conf, SERVER, ISSUER, own, BACKEND).policies[0].namespace == "{caller.namespace}"
    other = POLICY.replace('namespace = "team-a"', 'namespace = "ci-{caller.subject}"')
    found = problems(conf, SERVER, ISSUER, other, BACKEND)
    one(found, "policies[0].namespace", "a placeholder other than {caller.namespace}, the only one")
    bad = POLICY.replace('namespace = "team-a"', 'namespace = "Team_A"')
    one(problems(conf, SERVER, ISSUER, bad, BACKEND), "policies[0].namespace", "DNS-1123 label")
    gitlab = ISSUER.replace('provider = "kubernetes"', 'provider = "gitlab"')
    found = problems(conf, SERVER, gitlab, own, BACKEND)
    one(
        found,
        "policies[0].namespace",
        "issuer 'cluster' (provider 'gitlab') gives its callers none",
    )
    kept = gitlab + 'attributes = ["namespace", "project_path"]\n'
    assert load(conf, SERVER, kept, own, BACKEND).issuers[0].attributes == (
        "namespace",
        "project_path",
    )


def test_policy_grants(conf: Path) -> None:
    policy = POLICY.replace('["python-sandbox-warmpool"]', '["Python_Pool"]') + (
        'scopes = ["commands", "ports"]\nmax_lifetime_seconds = 0\nmax_sandboxes = -1\n'
        'subject = ""\n'
    )
    found = problems(conf, SERVER, ISSUER, policy, BACKEND)
    one(found, "policies[0].warm_pools", "'Python_Pool' is not a Kubernetes object name")
    one(found, "policies[0].scopes", "'ports' is not a scope (commands, files)")
    one(found, "policies[0].max_lifetime_seconds", "out of range", "> 0")
    one(found, "policies[0].max_sandboxes", "out of range", ">= 0")
    one(found, "policies[0].subject", "is empty", 'subject = "*"')
    fine = POLICY + 'scopes = ["files"]\nmax_lifetime_seconds = 600\n'
    policy_config = load(conf, SERVER, ISSUER, fine, BACKEND).policies[0]
    assert policy_config.scopes == ("files",) and policy_config.max_lifetime_seconds == 600


def test_policy_ports(conf: Path) -> None:
    """issue 23: ``ports`` (ports and ranges) reaches the policy; a bad entry names itself."""
    from k8s_agent_sandbox_awx.broker._identity_config import policy_rule

    default = load(conf, SERVER, ISSUER, POLICY, BACKEND).policies[0]
    assert default.ports == ("1024-65535",)
    given = POLICY + 'ports = [8000, "3000-3999"]\n'
    config = load(conf, SERVER, ISSUER, given, BACKEND).policies[0]
    assert config.ports == (8000, "3000-3999")
    assert policy_rule(config).policy().port_ranges.allows(3500)
    assert not policy_rule(config).policy().port_ranges.allows(8001)
    assert load(conf, SERVER, ISSUER, POLICY + "ports = []\n", BACKEND).policies[0].ports == ()
    for bad, shown in (('ports = ["9000-80"]', "'9000-80'"), ('ports = "8000"', "'8000'")):
        found = problems(conf, SERVER, ISSUER, POLICY + bad + "\n", BACKEND)
        one(found, "policies[0].ports", shown, "ports = [8000")


def test_claims(conf: Path) -> None:
    claims = 'claims = { "kubernetes.io.namespace" = "team-a", project_path = ["g/a", "g/b-*"] }\n'
    config = load(conf, SERVER, ISSUER, POLICY + claims, BACKEND)
    assert dict(config.policies[0].claims) == {
        "kubernetes.io.namespace": ("team-a",),
        "project_path": ("g/a", "g/b-*"),
    }
    wrong = 'claims = { ref_protected = true, run = 3, x = [], y = [1], "" = "a" }\n'
    found = problems(conf, SERVER, ISSUER, POLICY + wrong, BACKEND)
    one(found, "policies[0].claims.ref_protected", "matched as text", 'ref_protected = "true"')
    one(found, "policies[0].claims.run", "is an integer", 'run = "3"')
    one(found, "policies[0].claims.x", "an empty array")
    one(found, "policies[0].claims.y", "a string or an array of strings, not an array")
    one(found, 'policies[0].claims.""', "not a claim name")


def test_a_kubernetes_claim_name_spelled_as_toml_reads_it_is_named_with_the_fix(
    conf: Path,
) -> None:
    """The Kubernetes token's claim is ``kubernetes.io`` (a name with a dot), an object with
    ``namespace``: a policy matches it as ``"kubernetes.io.namespace"``, quoted. Unquoted, TOML
    reads nested tables; with a slash (a label's spelling) the key names no claim."""
    bare = 'claims = { kubernetes.io.namespace = "team-a" }\n'
    found = problems(conf, SERVER, ISSUER, POLICY + bare, BACKEND)
    one(
        found,
        "policies[0].claims.kubernetes",
        "TOML reads an unquoted dotted name as nested tables",
        '"kubernetes.io.namespace" = ...',
    )
    slash = 'claims = { "kubernetes.io/namespace" = "team-a" }\n'
    found = problems(conf, SERVER, ISSUER, POLICY + slash, BACKEND)
    one(
        found,
        'policies[0].claims."kubernetes.io/namespace"',
        "names no claim of a Kubernetes token",
        '"kubernetes.io.namespace"',
    )


def test_a_policy_after_a_catch_all_can_never_match(conf: Path) -> None:
    narrow = POLICY.replace('"team-a"\nissuer', '"narrow"\nissuer') + 'subject = "x:*"\n'
    found = problems(conf, SERVER, ISSUER, POLICY, narrow, BACKEND)
    one(
        found,
        "policies[1]",
        "can never match: policies[0] ('team-a') admits every caller",
        "move this policy before policies[0]",
    )
    # the other order is fine
    assert len(load(conf, SERVER, ISSUER, narrow, POLICY, BACKEND).policies) == 2


def test_policy_names_are_unique(conf: Path) -> None:
    again = POLICY + 'subject = "x"\n'
    found = problems(conf, SERVER, ISSUER, again, again, BACKEND)
    one(found, "policies[1].name", "'team-a' is also the name of policies[0]")


def test_backend_kind_selects_its_table(conf: Path) -> None:
    one(problems(conf, SERVER, ISSUER, POLICY, "[backend]\n"), "backend.kind", "is required")
    found = problems(conf, SERVER, ISSUER, POLICY, BACKEND.replace('"kubernetes"', '"k8s"', 1))
    one(found, "backend.kind", "'k8s' is not one of 'kubernetes', 'local'")
    found = problems(conf, SERVER, ISSUER, POLICY, '[backend]\nkind = "kubernetes"\n')
    one(found, "backend.kubernetes", "needs a [backend.kubernetes] table")
    both = BACKEND + '[backend.local]\ntemplates = { python = "" }\n'
    found = problems(conf, SERVER, ISSUER, POLICY, both)
    one(found, "backend.local", "only read with kind = 'local'", "set kind = 'local'")
    local = BACKEND.replace('kind = "kubernetes"', 'kind = "local"')
    found = problems(conf, SERVER, ISSUER, POLICY, local)
    one(found, "backend.kubernetes", "only read with kind = 'kubernetes'")


def test_the_local_backend(conf: Path) -> None:
    pools = POLICY.replace('["python-sandbox-warmpool"]', '["python", "echo"]')
    default = load(
        conf,
        SERVER,
        ISSUER,
        POLICY.replace("python-sandbox-warmpool", "python"),
        '[backend]\nkind = "local"\n',
    )
    assert default.backend.local and dict(default.backend.local.templates) == {"python": ""}
    assert default.backend.kubernetes is None and "backend.local" in default.defaulted
    local = (
        '[backend]\nkind = "local"\n[backend.local]\n'
        'templates = { python = "", echo = ["{python}", "echo.py", "--port", "{port}"] }\n'
    )
    config = load(conf, SERVER, ISSUER, pools, local)
    assert config.backend.local and dict(config.backend.local.templates) == {
        "python": "",
        "echo": ("{python}", "echo.py", "--port", "{port}"),
    }
    found = problems(conf, SERVER, ISSUER, pools, local.replace(", echo = [", ", ech = ["))
    one(
        found, "policies[0].warm_pools", "'echo' is not a template of [backend.local] (ech, python)"
    )
    bad = local.replace('"{port}"', '"{prot}"').replace('python = ""', "python = 3")
    found = problems(conf, SERVER, ISSUER, pools, bad)
    one(found, "backend.local.templates.echo", "unknown placeholder {prot}", "port_file")
    one(found, "backend.local.templates.python", "not an integer")
    assert not [p for p in found if p.key.startswith("policies")]  # no follow-up problem


def test_kubernetes_backend_rules(conf: Path) -> None:
    kubeconfig = BACKEND + 'connection = "kubeconfig"\n'
    one(
        problems(conf, SERVER, ISSUER, POLICY, kubeconfig),
        "backend.kubernetes.kubeconfig_file",
        "needs kubeconfig_file",
    )
    in_cluster = (
        BACKEND + 'kubeconfig_file = "kubeconfig"\ncontext = "c"\nallow_loopback_pod_ips = true\n'
    )
    found = problems(conf, SERVER, ISSUER, POLICY, in_cluster)
    one(found, "backend.kubernetes.kubeconfig_file", 'only used with connection = "kubeconfig"')
    one(found, "backend.kubernetes.context", 'only used with connection = "kubeconfig"')
    assert not [p for p in found if p.key.endswith("allow_loopback_pod_ips")]  # both planes
    ca = BACKEND + 'router_ca_file = "ca.crt"\n'
    one(
        problems(conf, SERVER, ISSUER, POLICY, ca),
        "backend.kubernetes.router_ca_file",
        "only used with an https:// router_url",
    )
    pod = BACKEND + 'data_plane = "pod"\nruntime_port = 70000\nrouter_pod_ip = false\n'
    found = problems(conf, SERVER, ISSUER, POLICY, pod)
    one(found, "backend.kubernetes.router_pod_ip", 'only used with data_plane = "router"')
    one(found, "backend.kubernetes.router_url", 'only used with data_plane = "router"')
    one(found, "backend.kubernetes.router_token_file", 'only used with data_plane = "router"')
    one(found, "backend.kubernetes.runtime_port", "out of range", "<= 65535")
    no_router = '[backend]\nkind = "kubernetes"\n[backend.kubernetes]\nready_timeout_seconds = 5\n'
    one(
        problems(conf, SERVER, ISSUER, POLICY, no_router),
        "backend.kubernetes.router_url",
        "needs router_url",
    )
    https = BACKEND.replace("http://", "https://") + 'router_ca_file = "ca.crt"\n'
    kube = load(conf, SERVER, ISSUER, POLICY, https).backend.kubernetes
    assert kube and kube.router_ca_file == conf / "ca.crt"
    pod_ok = (
        '[backend]\nkind = "kubernetes"\n[backend.kubernetes]\ndata_plane = "pod"\n'
        "allow_loopback_pod_ips = true\n"
    )
    kube = load(conf, SERVER, ISSUER, POLICY, pod_ok).backend.kubernetes
    assert (
        kube
        and kube.data_plane == "pod"
        and kube.allow_loopback_pod_ips
        and kube.router_url is None
    )


def test_the_file_itself(tmp_path: Path) -> None:
    with pytest.raises(BrokerConfigError, match="does not exist; fix: give --config") as info:
        load_config(tmp_path / "nope.toml")
    assert info.value.problems == (Problem("", "does not exist", info.value.problems[0].fix),)
    with pytest.raises(BrokerConfigError, match="is a directory"):
        load_config(tmp_path)
    (tmp_path / "bad.toml").write_text('[server]\nlisten = "x\n')
    with pytest.raises(BrokerConfigError, match=r"is not valid TOML: .*line 2"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "latin.toml").write_bytes(b"# caf\xe9\n")
    with pytest.raises(BrokerConfigError, match="is not UTF-8 text"):
        load_config(tmp_path / "latin.toml")


def test_the_renderer_prints_paths_never_contents_and_loads_back(conf: Path) -> None:
    config = load(conf, SERVER, ISSUER, POLICY + 'claims = { "a.b" = ["x", "y*"] }\n', BACKEND)
    text = render_config(config)
    assert SECRET not in text  # the files hold SECRET-...: shown by path only
    assert f'token_file = "{conf / "sa-token"}"' in text
    assert "tls_reload_seconds = 30  # default" in text
    assert 'public_url = "https://sandbox-broker.example.com"\n' in text
    assert "# jwks_url: not set (keys found by discovery)" in text
    again = load_config(write(conf, text, name="rendered.toml"))
    assert dataclasses.replace(again, path=config.path, defaulted=config.defaulted) == config
    # what is still defaulted is what was not set (rendered as a comment)
    assert again.defaulted < config.defaulted
    assert [k for k in again.defaulted if f"# {k.rsplit('.', 1)[1]}: " not in text] == []


def test_the_renderer_round_trips_every_table(conf: Path) -> None:
    issuer = ISSUER + (
        'audiences = ["a", "b"]\nalgorithms = ["ES256", "RS256"]\nclock_skew_seconds = 1.5\n'
        'jwks_url = "https://k.example/jwks"\nattributes = []\n'
    )
    local = (
        '[backend]\nkind = "local"\n[backend.local]\n'
        'templates = { "python-sandbox-warmpool" = ["{python}", "-m", "x"] }\n'
    )
    config = load(conf, SERVER.replace("0.0.0.0:8443", "[::]:0"), issuer, POLICY, local)
    again = load_config(write(conf, render_config(config), name="rendered.toml"))
    assert dataclasses.replace(again, path=config.path, defaulted=config.defaulted) == config
    assert tomllib.loads(render_config(config))["server"]["listen"] == "[::]:0"


def test_how_long_stale_keys_are_kept_is_configurable(conf: Path) -> None:
    """operate.md told operators to keep jwks_max_stale_seconds long enough to ride out an
    issuer's outage, but no [[issuers]] key set it (an unknown key, refused)."""
    from k8s_agent_sandbox_awx.broker._identity_config import issuer_settings

    default = load(conf, SERVER, ISSUER, POLICY, BACKEND).issuers[0]
    assert default.jwks_max_stale_seconds is None
    assert issuer_settings(default).keep_stale_seconds == 12 * 300
    longer = ISSUER + "jwks_max_stale_seconds = 86400\n"
    issuer = load(conf, SERVER, longer, POLICY, BACKEND).issuers[0]
    assert issuer.jwks_max_stale_seconds == 86400
    assert issuer_settings(issuer).keep_stale_seconds == 86400
    assert "jwks_max_stale_seconds = 86400" in render_config(
        load(conf, SERVER, longer, POLICY, BACKEND)
    )
    short = ISSUER + "jwks_cache_seconds = 600\njwks_max_stale_seconds = 60\n"
    one(
        problems(conf, SERVER, short, POLICY, BACKEND),
        "issuers[0].jwks_max_stale_seconds",
        "shorter than jwks_cache_seconds (600)",
        "at least jwks_cache_seconds",
    )
    review = ISSUER.replace('ca_file = "ca.crt"\ntoken_file = "sa-token"\n', "")
    review += 'verification = "tokenreview"\njwks_max_stale_seconds = 7200\n'
    one(
        problems(conf, SERVER, review, POLICY, BACKEND),
        "issuers[0].jwks_max_stale_seconds",
        'not used with verification = "tokenreview"',
    )
