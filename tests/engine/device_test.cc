// Runs everywhere: on a machine without a GPU it checks the "no CUDA device"
// answer; on a GPU machine it checks the properties.
#include "engine/device.h"

#include <gtest/gtest.h>

#include <string>

#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

TEST(DeviceTest, CountNeverThrowsAndExplainsZero) {
  const DeviceCount found = cuda_device_count();
  EXPECT_GE(found.count, 0);
  if (found.count == 0) {
    EXPECT_EQ(found.no_device_reason.rfind("no CUDA device", 0), 0u) << found.no_device_reason;
  } else {
    EXPECT_TRUE(found.no_device_reason.empty());
  }
}

TEST(DeviceTest, PropertiesOfDeviceZeroOrAClearNoDeviceError) {
  const DeviceCount found = cuda_device_count();
  if (found.count == 0) {
    try {
      device_properties(0);
      FAIL() << "device_properties(0) returned without a device";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kNoDevice);
      EXPECT_EQ(error.message(), found.no_device_reason);
    }
    return;
  }
  const DeviceProperties props = device_properties(0);
  EXPECT_FALSE(props.name.empty());
  EXPECT_GE(props.compute_major, 7);
  EXPECT_GT(props.total_memory_bytes, 1ull << 30);
  EXPECT_GT(props.multiprocessor_count, 0);
  const std::string text = describe(props);
  EXPECT_NE(text.find(props.name), std::string::npos) << text;
  EXPECT_NE(text.find("sm_"), std::string::npos) << text;
  const DeviceMemory memory = device_memory(0);
  EXPECT_GT(memory.free_bytes, 0u);
  EXPECT_LE(memory.free_bytes, memory.total_bytes);
}

TEST(DeviceTest, IndexBeyondTheDevicesIsANoDeviceError) {
  try {
    device_properties(1000);
    FAIL() << "device 1000 exists?";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNoDevice);
    EXPECT_NE(error.message().find("no CUDA device"), std::string::npos) << error.message();
  }
  if (cuda_device_count().count > 0) {
    EXPECT_ERROR_CONTAINS(device_properties(-1), "no CUDA device with index -1");
  } else {
    EXPECT_ERROR_CONTAINS(device_properties(-1), "no CUDA device");
  }
}

}  // namespace
}  // namespace stepgraph
