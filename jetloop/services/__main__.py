from jetloop.services.cli import main

main()
