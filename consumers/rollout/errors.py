"""Prompt rows the rollout stage cannot render go to ``prompts.<dataset>.errors``."""

from __future__ import annotations

from relax.consumers.rollout.prompts import PromptItem


def route_prompt_error(producer, item: PromptItem, e: Exception, engine_id: str) -> None:
    """Send the message ``item`` came in to ``<its topic>.errors`` with the reason
    (``e``), stage ``rollout/<engine_id>``; the stage goes on."""
    from relax.streams.codec import encode
    from relax.streams.errors import error_row

    d = item.delivery
    producer.send_errors(
        d.topic,
        [
            error_row(
                source_topic=d.topic,
                source_partition=d.partition,
                source_offset=d.offset,
                row=None,
                stage=f"rollout/{engine_id}",
                error=f"prompt {item.row.get('prompt_id')!r} cannot be rendered: "
                f"{type(e).__name__}: {e}",
                key=d.key,
                value=encode(d.table),
                headers=list(d.headers.items()),
            )
        ],
    )
