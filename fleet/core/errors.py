"""Every error the fleet raises, each tied to exactly one message code.

    FleetError                      (code E_INTERNAL)
     +-- ConfigError                 settings file or FLEET_* variable is wrong; names the key
     |    +-- DependencyMissing      a module this process needs is not installed; names the extra
     |    +-- PublicSecrets          E_AUTH: projects keep the example's published secrets
     |    +-- BrokerUnsafe           E_BROKER_UNSAFE: Redis without AOF or with eviction, refused
     +-- BrokerUnavailable           E_BROKER_UNAVAILABLE: Redis does not answer (producers, CLI)
     +-- JobError                    the job itself
     |    +-- InputInvalid           E_INPUT_INVALID
     |    +-- TooLarge               E_TOO_LARGE (a gateway body, file or batch over its limit,
     |    |                          a project over its quota of files or batches)
     |    +-- ToolRejected           E_TOOL_REJECTED (a tool the project refuses)
     |    +-- AuthError              E_AUTH
     |    +-- PromptTooLong          E_PROMPT_TOO_LONG
     |    +-- CollectFailed          E_COLLECT_FAILED
     |    +-- NotFound               E_NOT_FOUND (no such job in its project; the gateway: no
     |                               such task for this project)
     +-- Busy                        E_BUSY (too much of one caller's work in flight; carries
     |                               retry_after_s)
     +-- QuotaExceeded               E_QUOTA_EXCEEDED (the project's quota has no room; carries
     |                               retry_after_s when waiting helps)
     +-- AnswerError                 the model's answer
     |    +-- ThinkLoop              E_THINK_LOOP
     +-- UpstreamError               the backend (translated at the vLLM client boundary)
     |    +-- UpstreamTimeout        E_UPSTREAM_TIMEOUT / E_CONNECT_TIMEOUT /
     |    |                          E_FIRST_TOKEN_TIMEOUT / E_STREAM_STALLED
     |    +-- StreamDropped          E_STREAM_DROPPED
     |    +-- UpstreamUnavailable    E_UPSTREAM_UNAVAILABLE
     |    +-- UpstreamRejected       E_UPSTREAM_REJECTED
     +-- Cancelled                   E_CANCELLED
     +-- DeadlineExceeded            E_DEADLINE
     +-- QueueTimeout                E_QUEUE_TIMEOUT (the gateway: admission took too long)

Foreign exceptions are translated where they enter: httpx errors in the vLLM client
(fleet/infer/vllm.py), pydantic errors in the job parser and the settings loader. Redis errors are not
translated: the tasks' last line of defence turns whatever escapes into an E_INTERNAL envelope,
live events swallow them (fleet/core/events.py), the dispatcher backs off and retries.
"""

from __future__ import annotations

from fleet.core.codes import Code


class FleetError(Exception):
    code: Code = Code.E_INTERNAL
    retry_after_s: int | None = None  # when asking again makes sense (an HTTP Retry-After)

    def __init__(self, message: str, *, code: Code | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when there is one (an HTTP error's param)
        if code is not None:
            self.code = code


class ConfigError(FleetError):
    code = Code.E_INPUT_INVALID


class DependencyMissing(ConfigError):
    pass


class PublicSecrets(ConfigError):
    # E_AUTH, not E_INPUT_INVALID: the file is well formed, but anyone could sign jobs with it
    code = Code.E_AUTH


class BrokerUnsafe(ConfigError):
    code = Code.E_BROKER_UNSAFE


class BrokerUnavailable(FleetError):
    code = Code.E_BROKER_UNAVAILABLE


class JobError(FleetError):
    pass


class InputInvalid(JobError):
    code = Code.E_INPUT_INVALID


class TooLarge(JobError):
    code = Code.E_TOO_LARGE


class ToolRejected(JobError):
    code = Code.E_TOOL_REJECTED


class AuthError(JobError):
    code = Code.E_AUTH


class PromptTooLong(JobError):
    code = Code.E_PROMPT_TOO_LONG
    prompt_tokens: int | None = None  # the counted prompt, when counted
    room_tokens: int | None = None  # the most that fits


class CollectFailed(JobError):
    code = Code.E_COLLECT_FAILED


class NotFound(JobError):
    code = Code.E_NOT_FOUND


class Busy(FleetError):
    """Too much of one caller's work in flight: try again after ``retry_after_s``."""

    code = Code.E_BUSY

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(FleetError):
    """The project's quota has no room for this request (schedulers/policy/quota.py ``refusal``)."""

    code = Code.E_QUOTA_EXCEEDED

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AnswerError(FleetError):
    pass


class ThinkLoop(AnswerError):
    code = Code.E_THINK_LOOP


class UpstreamError(FleetError):
    code = Code.E_UPSTREAM_ERROR


class UpstreamTimeout(UpstreamError):
    code = Code.E_UPSTREAM_TIMEOUT


class StreamDropped(UpstreamError):
    code = Code.E_STREAM_DROPPED


class UpstreamUnavailable(UpstreamError):
    code = Code.E_UPSTREAM_UNAVAILABLE


class UpstreamRejected(UpstreamError):
    code = Code.E_UPSTREAM_REJECTED


class Cancelled(FleetError):
    code = Code.E_CANCELLED


class DeadlineExceeded(FleetError):
    code = Code.E_DEADLINE


class QueueTimeout(FleetError):
    code = Code.E_QUEUE_TIMEOUT
