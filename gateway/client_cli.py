"""`kvd-cli`: templates, generation and info from the command line.

    kvd-cli info
    kvd-cli template create support-bot --content "You are ..." [--ttl 3600] [--description D]
    kvd-cli template create support-bot --file prompt.txt
    kvd-cli template create support-chat --message "system:You are ..." [--message "user:..." ...]
    kvd-cli template get|delete NAME
    kvd-cli template list
    kvd-cli template update NAME [--ttl S] [--description D]
    kvd-cli generate [--template NAME] [--chat] [--stream] [--max-new-tokens N] PROMPT

The gateway is --address (KVD_GATEWAY_ADDR, default 127.0.0.1:50051); the key
--api-key (KVD_API_KEY). Errors print the gateway's status and message (exit 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import grpc
from google.protobuf.json_format import MessageToDict

from gateway.client import GatewayClient
from kvd.common.defaults import GATEWAY_ADDRESS
from kvd.common.settings import EPILOG, Setting
from kvd_api.gateway.v1 import gateway_pb2 as pb


def _show(message) -> None:
    click.echo(json.dumps(MessageToDict(message), indent=2))


_CONTEXT = {"help_option_names": ["-h", "--help"]}


#: The gateway and the key: what every command needs.
SETTINGS = [
    Setting("--address", env="KVD_GATEWAY_ADDR", default=GATEWAY_ADDRESS, help="the gateway: HOST:PORT"),
    Setting("--api-key", env="KVD_API_KEY", help="the API key; empty: single-user mode"),
    Setting("--tls-ca", help="PEM file to trust: connect with TLS"),
]


@click.group("kvd-cli", help="Talks to the kvd gateway.", epilog=EPILOG, params=SETTINGS, context_settings=_CONTEXT)
@click.pass_context
def cli(ctx: click.Context, address: str, api_key: str, tls_ca: str) -> None:
    tls = Path(tls_ca) if tls_ca else None
    ctx.obj = ctx.with_resource(GatewayClient(address, api_key=api_key or None, root_certificates=tls))


@cli.command(help="model, block size, context, templates")
@click.pass_obj
def info(kvd: GatewayClient) -> None:
    _show(kvd.info())


@cli.group(help="named prefix templates")
def template() -> None:
    pass


@template.command(help="a text template (--content or --file) or a chat template (--message ...)")
@click.argument("name")
@click.option("--content", help="the template's text")
@click.option("--file", type=click.Path(path_type=Path, dir_okay=False), help="a file holding the template's text")
@click.option("--message", multiple=True, metavar="ROLE:CONTENT", help="a chat template's message (repeat for several)")
@click.option("--ttl", type=int, default=0, show_default=True, help="seconds; 0: never expires")
@click.option("--description")
@click.pass_obj
def create(kvd: GatewayClient, name: str, content, file, message, ttl: int, description: str) -> None:
    if sum(x is not None and x != () for x in (content, file, message)) != 1:
        raise click.UsageError("give exactly one of --content, --file, --message")
    if message:
        messages = [tuple(m.split(":", 1)) for m in message]
        if any(len(m) != 2 for m in messages):
            raise SystemExit("kvd-cli: --message takes ROLE:CONTENT")
        _show(kvd.create_template(name, "", ttl, description, messages=messages))
        return
    text = content if content is not None else file.read_text()
    _show(kvd.create_template(name, text, ttl, description))


@template.command(help="a template's content and counts")
@click.argument("name")
@click.pass_obj
def get(kvd: GatewayClient, name: str) -> None:
    _show(kvd.get_template(name))


@template.command(help="deletes a template (and unpins it)")
@click.argument("name")
@click.pass_obj
def delete(kvd: GatewayClient, name: str) -> None:
    kvd.delete_template(name)
    click.echo(f"deleted {name}")


@template.command("list", help="the tenant's templates, by name")
@click.pass_obj
def list_(kvd: GatewayClient) -> None:
    for t in kvd.list_templates():
        click.echo(f"{t.name}\t{t.token_count} tokens\t{t.cached_token_count} pinned\t{t.description}")


@template.command(help="a template's TTL or description (its content never changes)")
@click.argument("name")
@click.option("--ttl", type=int, help="seconds; 0 removes the expiry")
@click.option("--description")
@click.pass_obj
def update(kvd: GatewayClient, name: str, ttl: int | None, description: str | None) -> None:
    _show(kvd.update_template(name, ttl, description))


@cli.command(help="generate text")
@click.argument("prompt")
@click.option("--template", "template_name", help="a template's name: its tokens come first")
@click.option("--chat", is_flag=True, help="send the prompt as one user chat message")
@click.option("--stream", is_flag=True, help="print tokens as they come")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float)
@click.option("--seed", type=int)
@click.option("--cache-ttl", type=click.Choice(["5m", "1h"]), help="keep the whole prompt cached this long")
@click.option("--diagnose-cache", is_flag=True, help="say why the prompt missed the cache")
@click.pass_obj
def generate(
    kvd: GatewayClient, prompt: str, template_name: str, chat: bool, stream: bool, cache_ttl: str | None,
    diagnose_cache: bool, **sampling,
) -> None:  # fmt: skip
    sampling = {k: v for k, v in sampling.items() if v is not None}
    text = {"chat": [("user", prompt)]} if chat else {"prompt": prompt}
    if cache_ttl:
        ttl = pb.CACHE_TTL_1H if cache_ttl == "1h" else pb.CACHE_TTL_5M
        sampling["cache_breakpoints"] = [pb.CacheBreakpoint(prompt=True, ttl=ttl)]
    args = {**text, "template": template_name, "diagnose_cache": diagnose_cache, **sampling}
    last = None
    for reply in kvd.generate(**args) if stream else [kvd.complete(**args)]:
        click.echo(reply.text, nl=not stream)
        sys.stdout.flush()
        last = reply if reply.HasField("usage") else last
    if stream:
        click.echo()
    if last is not None:
        _show(last.usage)
        if last.HasField("cache_diagnosis"):
            _show(last.cache_diagnosis)


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="kvd-cli", standalone_mode=False)
    except grpc.RpcError as err:
        click.echo(f"kvd-cli: {err.code().name}: {err.details()}", err=True)
        return 1
    except click.exceptions.Exit as done:  # --help
        return done.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
