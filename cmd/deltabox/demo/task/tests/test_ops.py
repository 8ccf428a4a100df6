import unittest

from calc import add, clamp, mean


class TestAdd(unittest.TestCase):
    def test_positive(self):
        self.assertEqual(add(2, 3), 5)

    def test_zero(self):
        self.assertEqual(add(7, 0), 7)


class TestMean(unittest.TestCase):
    def test_several(self):
        self.assertEqual(mean([1, 2, 3, 6]), 3)

    def test_one(self):
        self.assertEqual(mean([4]), 4)


class TestClamp(unittest.TestCase):
    def test_inside(self):
        self.assertEqual(clamp(5, 0, 10), 5)

    def test_outside(self):
        self.assertEqual(clamp(-5, 0, 10), 0)
        self.assertEqual(clamp(50, 0, 10), 10)


if __name__ == "__main__":
    unittest.main()
