"""The bootstrap fields sglang-router adds to each request it sends to a prefill and a decode server (P/D
disaggregation): where the prefill server's bootstrap server is, and the room pairing the two halves."""

from __future__ import annotations

from pydantic import BaseModel, StrictInt, StrictStr

from runtime.http.api_errors import bad_request
from runtime.messages import Bootstrap

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class BootstrapFields(BaseModel):
    bootstrap_host: StrictStr | None = None
    bootstrap_port: StrictInt | None = None
    bootstrap_room: StrictInt | None = None

    def bootstrap(self, prompts: int) -> Bootstrap | None:
        """The request's bootstrap (None: an ordinary request); a 400 when only some fields come, or when a room
        would pair more than one prompt (SGLang's per-prompt lists are not served yet)."""
        given = [getattr(self, name) for name in BOOTSTRAP_FIELDS]
        if all(v is None for v in given):
            return None
        missing = [name for name, v in zip(BOOTSTRAP_FIELDS, given, strict=True) if v is None]
        if missing:
            sent = [name for name, v in zip(BOOTSTRAP_FIELDS, given, strict=True) if v is not None]
            raise bad_request(f"{', '.join(sent)} without {', '.join(missing)}: the bootstrap fields come together "
                              "(sglang-router sends all three)", missing[0])
        if prompts != 1:
            raise bad_request("a bootstrap room pairs one prompt: batches in P/D disaggregation are not supported "
                              "yet", "bootstrap_room")
        return Bootstrap(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)  # type: ignore[arg-type]
