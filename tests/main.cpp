// Catch2 v2 only: the test runner's main(). Under Catch2 v3 this file is not compiled
// (Catch2::Catch2WithMain provides main).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
