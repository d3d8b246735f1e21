from bcstack.cli import main

main()
