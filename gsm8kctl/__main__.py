from gsm8kctl.cli import main

main()
