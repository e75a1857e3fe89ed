"""``python -m lopd_cli`` = the ``lopd`` console script."""

from lopd_cli.main import main

main()
