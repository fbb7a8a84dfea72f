"""Secrets: held by reference in the configuration, resolved at launch, masked wherever they land.

- `serve.secrets` maps a variable of the server's environment to a REFERENCE, never a value:
  `env:NAME` (a variable of the process that launches the server: the Prefect worker, your shell)
  or `prefect:BLOCK` (a Prefect Secret block, resolved by the Prefect tasks, which register that
  resolver; the library never imports Prefect). The value exists only in the launching process and
  in the server's environment: never in the configuration, Prefect's database or a file we write.
  `{secret:NAME}` in `serve.extra_args` / `serve.command` expands to the value at launch.
- Masking is by allow-list: what we save or log of an environment shows the values of variables
  known to be harmless (NCCL_*, CUDA_*, ...), every other value is masked; credentials inside
  URLs and the values of secret-looking flags (`--api-key X`, `--token=X`) are masked too; the
  values of resolved secrets are masked by value wherever they stand, in every launch record, pid
  file, server log line and message we write or forward (`redact_argv`, `redact_obj`, `Redactor`).
"""
from __future__ import annotations

import os
import re
from typing import Callable, Iterable, Mapping

from drafter.errors import DrafterError

MASK = "<masked>"

# Variables whose values are safe to save and show: tuning and placement, never credentials.
_SAFE_PREFIXES = ("NCCL_", "CUDA_", "NVIDIA_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "OMP_", "MKL_",
                  "OPENBLAS_", "SGLANG_", "VLLM_", "HF_HUB_", "HF_DATASETS_", "TRANSFORMERS_", "TOKENIZERS_",
                  "PYTHON", "LC_", "GLOO_", "TP_", "NVTE_", "TRITON_", "DRAFTER_SERVER_TAG")
_SAFE_NAMES = {"PATH", "HOME", "LANG", "TZ", "TERM", "USER", "HOSTNAME", "PWD", "SHELL", "TMPDIR",
               "HF_HOME", "LD_LIBRARY_PATH", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
               "LOCAL_RANK", "NODE_RANK"}
# ... unless the name itself says it holds a credential (VLLM_API_KEY, HF_HUB_TOKEN, ...).
# TOKEN but not TOKENIZER: TOKENIZERS_PARALLELISM is a tuning flag, not a credential.
_SECRET_WORD = re.compile(r"KEY|TOKEN(?!IZER)|SECRET|PASS|AUTH|CRED|COOKIE|SESSION|PRIVATE|SIGNATURE|PAT\b|_PAT_",
                          re.IGNORECASE)
# A flag is secret-looking when one of its words names a credential: `--api-key`, `--hf-token`,
# `--ssl-keyfile-password`. Whole words only: `--speculative-num-draft-tokens` is a count and
# `--tokenizer-path` a path, and masking them would make the saved launch record unreproducible.
_SECRET_FLAG_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "pass", "passphrase", "auth",
                      "credential", "credentials", "cookie"}


def _secret_flag(flag: str) -> bool:
    if not flag.startswith("-"):
        return False
    return any(word in _SECRET_FLAG_WORDS for word in re.split(r"[-_]", flag.lstrip("-").lower()))


_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][\w+.-]*://)(?P<user>[^/\s:@]*):(?P<password>[^/\s@]+)@")
_URL_QUERY_SECRET = re.compile(
    r"(?P<name>[?&](?:[\w.-]*(?:key|token|secret|password|sig|signature|auth|credential)[\w.-]*))=(?P<value>[^&\s#]+)",
    re.IGNORECASE)
_REFERENCE = re.compile(r"^(env|prefect):(\S+)$")
_PLACEHOLDER = re.compile(r"\{secret:([A-Za-z_][A-Za-z0-9_]*)\}")


class SecretError(DrafterError):
    """A secret reference that cannot be resolved here (unset variable, no such block)."""

    exit_code = 2


def secret_looking_env(env: Mapping[str, str]) -> list[str]:
    """Warnings for values typed into `serve.env` that hold a credential, by name (`..._TOKEN`) or by
    value (a URL carrying one: `postgres://u:PASSWORD@h/db`, `?token=...`): that section is
    configuration, stored wherever the configuration goes (Prefect's database, the UI)."""
    return [f"serve.env.{name} looks like a secret"
            + ("" if _SECRET_WORD.search(name) else " (its value is a URL carrying credentials)")
            + f": serve.env is configuration and is stored with the run "
            f"(Prefect parameters, the UI); reference it instead: serve.secrets: {{{name}: env:{name}}}"
            for name, value in sorted(env.items())
            if _SECRET_WORD.search(name) or mask_text(str(value)) != str(value)]


def safe_name(name: str) -> bool:
    """May the value of environment variable `name` be saved or shown?"""
    if _SECRET_WORD.search(name):
        return False
    return name in _SAFE_NAMES or name.startswith(_SAFE_PREFIXES)


def mask_text(text: str) -> str:
    """Credentials inside URLs (`scheme://user:password@host`, `?token=...`) masked."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _URL_QUERY_SECRET.sub(lambda m: f"{m['name']}={MASK}", text)


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """Allow-listed variables keep their (URL-masked) value; every other value is masked."""
    return {k: (mask_text(v) if safe_name(k) else MASK) for k, v in sorted(env.items())}


def mask_argv(argv: Iterable[str]) -> list[str]:
    """The value after a secret-looking flag (`--api-key X`, `--hf-token=X`) and URL credentials masked."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        flag, eq, _value = arg.partition("=")
        if _secret_flag(flag):
            if eq:
                out.append(f"{flag}={MASK}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(mask_text(arg))
    return out


def secret_values(env: Mapping[str, str], argv: Iterable[str] = ()) -> set[str]:
    """The values masking hides: of non-allow-listed variables and of secret-looking flags; what a
    `Redactor` removes from log lines."""
    values = {v for k, v in env.items() if not safe_name(k)}
    argv = list(argv)
    for masked, real in zip(mask_argv(argv), argv):
        if masked != real:
            flag, eq, value = real.partition("=")
            values.add(value if eq and _secret_flag(flag) else real)
    return {v for v in values if len(v) >= 6}  # short values ("1", "true") would mask everything


def redact_argv(argv: Iterable[str], redact: Callable[[str], str]) -> list[str]:
    """A command line as we save it: secret-looking flags' values masked (`mask_argv`) AND the known
    secret values wherever they stand (`--extra-x S`, `--header=Authorization: Bearer S`)."""
    return [redact(arg) for arg in mask_argv(argv)]


def redact_obj(obj, redact: Callable[[str], str]):
    """Every string inside `obj` (dicts, lists, tuples: a record about to be written) redacted."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, Mapping):
        return {k: redact_obj(v, redact) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v, redact) for v in obj]
    return obj


class Redactor:
    """Replaces known secret values (and URL credentials) in text: server log lines, messages."""

    def __init__(self, values: Iterable[str] = ()):
        ordered = sorted({v for v in values if v}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(v) for v in ordered)) if ordered else None

    def __call__(self, text: str) -> str:
        if self._pattern is not None:
            text = self._pattern.sub(MASK, text)
        return mask_text(text)


# ---- references

_RESOLVERS: dict[str, Callable[[str], str]] = {}


def register_resolver(scheme: str, resolve: Callable[[str], str]) -> None:
    """`prefect:` references resolve through a function the Prefect tasks register."""
    _RESOLVERS[scheme] = resolve


def reference_problem(reference: str) -> str | None:
    if not _REFERENCE.match(reference):
        return ("not a secret reference; use env:VARIABLE or prefect:BLOCK_NAME "
                "(the value itself never belongs in the configuration)")
    return None


def resolve(name: str, reference: str) -> str:
    match = _REFERENCE.match(reference)
    if match is None:
        raise SecretError(f"serve.secrets.{name}: {reference_problem(reference)}")
    scheme, target = match.groups()
    if scheme == "env":
        value = os.environ.get(target)
        if value is None:
            raise SecretError(f"serve.secrets.{name}: environment variable {target} is not set in this process "
                              f"(pid {os.getpid()}: the shell or Prefect worker that launches the server)")
        return value
    resolver = _RESOLVERS.get(scheme)
    if resolver is None:
        raise SecretError(f"serve.secrets.{name}: {scheme}: references resolve only inside a Prefect run; "
                          f"use env:VARIABLE from a terminal")
    try:
        return resolver(target)
    except Exception as err:
        raise SecretError(f"serve.secrets.{name}: cannot read {reference}: {type(err).__name__}: {err}") from None


def resolve_all(references: Mapping[str, str]) -> dict[str, str]:
    """{variable: value} for `serve.secrets`; SecretError names the first that fails."""
    return {name: resolve(name, ref) for name, ref in references.items()}


def expand_placeholders(argv: Iterable[str], values: Mapping[str, str]) -> list[str]:
    """`{secret:NAME}` -> the resolved value of serve.secrets NAME."""
    def one(arg: str) -> str:
        def sub(m: re.Match) -> str:
            if m[1] not in values:
                raise SecretError(f"{{secret:{m[1]}}} in the server command line: no serve.secrets.{m[1]}")
            return values[m[1]]
        return _PLACEHOLDER.sub(sub, arg)
    return [one(a) for a in argv]
