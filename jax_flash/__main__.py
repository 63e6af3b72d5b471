"""``python -m jax_flash``: print the capability report and run the self-check."""

from __future__ import annotations

import argparse
import json
import sys

from jax_flash.capabilities import capabilities, format_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_flash", description="jax_flash build, devices and self-check"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-self-check", action="store_true", help="skip the self-check")
    parser.add_argument(
        "--budget", type=float, default=2.0, help="self-check seconds per device (default 2)"
    )
    args = parser.parse_args(argv)
    report = capabilities(self_check=not args.no_self_check, budget_s=args.budget)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    checks = [d["self_check"] for d in report["devices"] if d.get("self_check")]
    return 0 if all(c["passed"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
