/* main.c: ./run's entry point; everything it does is cli.c's cli_main (kept apart so tests link the parser). */
#include "cli.h"

int main(int argc, char **argv) { return cli_main(argc, argv); }
