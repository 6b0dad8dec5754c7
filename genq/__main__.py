from genq.cli import main

main()
