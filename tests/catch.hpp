#pragma once
// Catch2 shim: every test file includes "catch.hpp". tests/CMakeLists.txt defines
// TITANS_CATCH2_V3=1 when it found Catch2 v3 (linked with Catch2::Catch2WithMain); otherwise the
// header-only Catch2 v2 is used and tests/main.cpp provides main().
#if defined(TITANS_CATCH2_V3) && TITANS_CATCH2_V3
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif
