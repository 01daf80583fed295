// Shared GoogleTest main: runs the tests single-threaded in BLAS so timings and results are stable.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
