from tandem_inference.tinker.main import main

main()
