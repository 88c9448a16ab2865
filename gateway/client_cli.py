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
--api-key (KVD_API_KEY). Errors print the gateway's status and message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from gateway.client import GatewayClient


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvd-cli", description="Talks to the kvd gateway.")
    p.add_argument("--address", default=os.environ.get("KVD_GATEWAY_ADDR", "127.0.0.1:50051"))
    p.add_argument("--api-key", default=os.environ.get("KVD_API_KEY", ""), help="(KVD_API_KEY)")
    p.add_argument("--tls-ca", default="", help="PEM file to trust: connect with TLS")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="model, block size, context, templates")

    tpl = sub.add_parser("template", help="named prefix templates").add_subparsers(dest="action", required=True)
    create = tpl.add_parser("create")
    create.add_argument("name")
    source = create.add_mutually_exclusive_group(required=True)
    source.add_argument("--content")
    source.add_argument("--file", type=Path)
    source.add_argument(
        "--message", action="append", metavar="ROLE:CONTENT", help="a chat template's message (repeat for several)"
    )
    create.add_argument("--ttl", type=int, default=0, help="seconds; 0: never expires")
    create.add_argument("--description", default="")
    for action in ("get", "delete"):
        tpl.add_parser(action).add_argument("name")
    tpl.add_parser("list")
    update = tpl.add_parser("update")
    update.add_argument("name")
    update.add_argument("--ttl", type=int, help="seconds; 0 removes the expiry")
    update.add_argument("--description")

    gen = sub.add_parser("generate", help="generate text")
    gen.add_argument("prompt", nargs="?", default="")
    gen.add_argument("--template", default="")
    gen.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--seed", type=int)
    return p


def _show(message) -> None:
    print(json.dumps(MessageToDict(message), indent=2))


def _template(kvd: GatewayClient, args) -> None:
    if args.action == "create":
        if args.message:
            messages = [tuple(m.split(":", 1)) for m in args.message]
            if any(len(m) != 2 for m in messages):
                raise SystemExit("kvd-cli: --message takes ROLE:CONTENT")
            _show(kvd.create_template(args.name, "", args.ttl, args.description, messages=messages))
            return
        content = args.content if args.content is not None else args.file.read_text()
        _show(kvd.create_template(args.name, content, args.ttl, args.description))
    elif args.action == "get":
        _show(kvd.get_template(args.name))
    elif args.action == "delete":
        kvd.delete_template(args.name)
        print(f"deleted {args.name}")
    elif args.action == "list":
        for t in kvd.list_templates():
            print(f"{t.name}\t{t.token_count} tokens\t{t.cached_token_count} pinned\t{t.description}")
    else:
        _show(kvd.update_template(args.name, args.ttl, args.description))


def _generate(kvd: GatewayClient, args) -> None:
    sampling = {"max_new_tokens": args.max_new_tokens}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if args.seed is not None:
        sampling["seed"] = args.seed
    prompt = {"chat": [("user", args.prompt)]} if args.chat else {"prompt": args.prompt}
    if not args.stream:
        reply = kvd.complete(**prompt, template=args.template, **sampling)
        print(reply.text)
        _show(reply.usage)
        return
    usage = None
    for chunk in kvd.generate(**prompt, template=args.template, **sampling):
        print(chunk.text, end="", flush=True)
        usage = chunk.usage if chunk.HasField("usage") else usage
    print()
    if usage is not None:
        _show(usage)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tls_ca = Path(args.tls_ca) if args.tls_ca else None
    with GatewayClient(args.address, api_key=args.api_key or None, root_certificates=tls_ca) as kvd:
        try:
            if args.command == "info":
                _show(kvd.info())
            elif args.command == "template":
                _template(kvd, args)
            else:
                _generate(kvd, args)
        except grpc.RpcError as err:
            print(f"kvd-cli: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
